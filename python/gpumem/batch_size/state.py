"""The state guard: everything a trial may change is saved first and put back bit for bit.

Parameters, buffers, gradients, the user's optimizer state and param groups, train/eval flags and
the RNG states; copies live in host memory, so the guard costs no device memory.
"""
from __future__ import annotations

import copy
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn as nn


class _StateGuard:
    """Snapshot of everything a trial may change; restore() puts it back bit for bit.

    Parameters, buffers, gradients and the user's optimizer state are copied to host
    memory (no device memory is spent on the copy).  Between trials only what costs
    memory is reset (gradients dropped, optimizer state created by a trial deleted);
    values are restored once, at the end.
    """

    def __init__(self, model: Optional[nn.Module], optimizer: Optional[torch.optim.Optimizer],
                 device: torch.device):
        self.model = model
        self.optimizer = optimizer
        self.device = device
        self.params: List[Tuple[torch.Tensor, torch.Tensor]] = []
        self.grads: List[Tuple[torch.Tensor, Optional[torch.Tensor]]] = []
        self.buffers: List[Tuple[nn.Module, str, torch.Tensor, torch.Tensor]] = []
        self.flags: List[Tuple[nn.Module, bool]] = []
        self.opt_state: Dict[Any, Dict[str, Any]] = {}
        self.opt_groups: List[Dict[str, Any]] = []
        self.cpu_rng = torch.get_rng_state()
        self.cuda_rng = None
        if device.type == "cuda":
            self.cuda_rng = torch.cuda.get_rng_state(device)
        if model is not None:
            seen = set()
            for p in model.parameters():
                if id(p) in seen:
                    continue
                seen.add(id(p))
                self.params.append((p, p.detach().to("cpu", copy=True)))
                g = p.grad
                self.grads.append((p, None if g is None else g.detach().to("cpu", copy=True)))
            for mod in model.modules():
                self.flags.append((mod, mod.training))
                for name, buf in mod._buffers.items():
                    if buf is not None:
                        self.buffers.append((mod, name, buf, buf.detach().to("cpu", copy=True)))
            for p, _ in self.grads:  # trials start without gradients, as after zero_grad()
                p.grad = None
        if optimizer is not None:
            for p, st in optimizer.state.items():
                saved = {}
                for k, v in st.items():
                    if torch.is_tensor(v):
                        saved[k] = (v, v.detach().to("cpu", copy=True))
                    else:
                        saved[k] = (None, copy.deepcopy(v))
                self.opt_state[p] = saved
            self.opt_groups = [{k: copy.deepcopy(v) for k, v in g.items() if k != "params"}
                               for g in optimizer.param_groups]

    def between_trials(self) -> None:
        """Drop what a trial allocated for good: gradients, optimizer state it created."""
        for p, _ in self.grads:
            p.grad = None
        if self.optimizer is not None:
            for p in list(self.optimizer.state.keys()):
                if p not in self.opt_state:
                    del self.optimizer.state[p]

    def restore(self) -> None:
        with torch.no_grad():
            for p, saved in self.params:
                p.copy_(saved)
            for mod, name, buf, saved in self.buffers:
                if mod._buffers.get(name) is not buf:
                    mod._buffers[name] = buf
                buf.copy_(saved)
            for p, g in self.grads:
                p.grad = None if g is None else g.to(p.device)
        for mod, flag in self.flags:
            mod.training = flag
        if self.optimizer is not None:
            opt = self.optimizer
            for p in list(opt.state.keys()):
                if p not in self.opt_state:
                    del opt.state[p]
            with torch.no_grad():
                for p, saved in self.opt_state.items():
                    st = opt.state[p]
                    for k in list(st.keys()):
                        if k not in saved:
                            del st[k]
                    for k, (orig, val) in saved.items():
                        if orig is not None:
                            orig.copy_(val)
                            st[k] = orig
                        else:
                            st[k] = copy.deepcopy(val)
            for g, saved_g in zip(opt.param_groups, self.opt_groups):
                for k in [k for k in g if k != "params" and k not in saved_g]:
                    del g[k]
                g.update(copy.deepcopy(saved_g))
        torch.set_rng_state(self.cpu_rng)
        if self.cuda_rng is not None:
            torch.cuda.set_rng_state(self.cuda_rng, self.device)
