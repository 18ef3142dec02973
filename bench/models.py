"""Models the GPU benchmarks and GPU tests train (torch only, no gpumem).

GPT is ../shared/bench/workloads.py's transformer language model (217M parameters at the
defaults); bench/batch_size_bench.py uses those defaults, tests/gpu/ a small copy.
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
