"""What the GPU benchmarks and GPU tests train, and how they look into torch (torch only, no gpumem).

GPT is the transformer language model of bench/workloads.py's varlen workload and of bench/soak.py
(217M parameters at the defaults); bench/batch_size_bench.py uses those defaults, bench/compile_bench.py
and tests/gpu/ smaller ones. resnet50() is the resnet workload's network (the layers and shapes of
torchvision's ResNet-50, without needing torchvision). cudagraph_tree_counts() reads what
torch.compile(mode="reduce-overhead") recorded (bench/compile_bench.py, tests/gpu/compile_scenario.py).
"""
import torch.nn as nn


class GPT(nn.Module):
    """Pre-norm transformer LM, causal mask, untied output head."""

    def __init__(self, vocab=32000, d=1024, layers=12, heads=16):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(d, heads, 4 * d, dropout=0.0, batch_first=True, norm_first=True)
            for _ in range(layers))
        self.head = nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        x = self.emb(ids)
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], device=ids.device, dtype=x.dtype)
        for b in self.blocks:
            x = b(x, src_mask=mask, is_causal=True)
        return self.head(x)


class Bottleneck(nn.Module):
    """1x1 down to `width`, 3x3 (strided), 1x1 up to 4 * width; the shortcut added in place, then ReLU."""

    def __init__(self, cin, width, stride):
        super().__init__()
        cout = 4 * width
        self.body = nn.Sequential(
            nn.Conv2d(cin, width, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, width, 3, stride, 1, bias=False), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            nn.Conv2d(width, cout, 1, bias=False), nn.BatchNorm2d(cout))
        self.shortcut = nn.Identity() if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
        self.relu = nn.ReLU(inplace=True)

    def forward(self, x):
        out = self.body(x)
        out += self.shortcut(x)
        return self.relu(out)


def resnet50(classes=1000, stages=((64, 3), (128, 4), (256, 6), (512, 3))):
    """ResNet-50 (25.6M parameters): a 7x7 stem, four stages of bottlenecks (the first of each stage
    after the first strided by 2), global average pooling, one linear layer."""
    layers = [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True),
              nn.MaxPool2d(3, 2, 1)]
    cin = 64
    for s, (width, blocks) in enumerate(stages):
        for i in range(blocks):
            layers.append(Bottleneck(cin, width, 2 if s > 0 and i == 0 else 1))
            cin = 4 * width
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(cin, classes)]
    return nn.Sequential(*layers)


def cudagraph_tree_counts(torch):
    """(CUDA graphs recorded, checkpoint restores) of the current device's cudagraph trees: (0, 0)
    before any, (None, None) where torch's private internals differ from what this reads."""
    try:
        from torch._inductor import cudagraph_trees as ct

        mgr = ct.get_container(torch.cuda.current_device()).tree_manager
        if mgr is None:
            return 0, 0
        stack = [n for nodes in mgr.roots.values() for n in nodes]
        count = 0
        while stack:
            node = stack.pop()
            count += 1
            stack.extend(c for kids in node.children.values() for c in kids)
        return count, getattr(mgr, "debug_checkpointing_counter", None)
    except Exception:  # noqa: BLE001  private API of another torch version
        return None, None
