"""What the GPU benchmarks and GPU tests train (torch only, no gpumem).

GPT is the transformer language model of bench/workloads.py's varlen workload and of bench/soak.py
(217M parameters at the defaults); bench/batch_size_bench.py uses those defaults, bench/compile_bench.py
and tests/gpu/ smaller ones. resnet50() is the resnet workload's network (the layers and shapes of
torchvision's ResNet-50, without needing torchvision).
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

