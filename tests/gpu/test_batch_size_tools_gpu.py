"""GPU tests of the batch-size tools with the real libraries (every test marked ``gpu``):
the OOM-retry decorator, the Lightning callback against Lightning's own finder, the Hugging Face
Trainer path (a tiny GPT-2 built from its config: no downloads), generate mode with a KV cache,
and the sequence-length search.

    pytest -m gpu tests/gpu/test_batch_size_tools_gpu.py -q

The process is capped at CAP bytes (a search's budget is at most the cap) and each search has a
smaller budget still, so the tests do not depend on the GPU's size.
"""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "bench"))  # bench/models.py

CAP = 6 << 30
SEQ = 256
VOCAB = 8000

# Lightning / transformers' deprecation warnings against this torch are theirs.
pytestmark = [pytest.mark.gpu, pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]


@pytest.fixture(autouse=True)
def capped():
    import gpumem  # noqa: F401  before CUDA starts
    import torch

    total = torch.cuda.mem_get_info()[1]
    torch.cuda.set_per_process_memory_fraction(min(1.0, CAP / total))
    yield
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(1.0)


def small_gpt():
    import torch

    from models import GPT

    torch.manual_seed(0)
    return GPT(vocab=VOCAB, d=256, layers=4, heads=4).cuda()


def gpt_step(model, opt, b, seq=SEQ):
    import torch
    import torch.nn.functional as F

    ids = torch.randint(0, VOCAB, (b, seq), device="cuda")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        loss = F.cross_entropy(model(ids).flatten(0, 1), ids.flatten())
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


# ----------------------------------------------------------------------------- the decorator


def test_decorator_retries_on_real_oom_and_frees_the_failed_try():
    import torch

    import gpumem

    model = small_gpt()
    # One step at batch 1 first: torch's cuBLAS workspaces (32 MiB a handle on an H100) are made by the
    # first matmul and kept for the process's life; they are torch's, not a failed try's.
    warm = torch.optim.AdamW(model.parameters())
    gpt_step(model, warm, 1)
    del warm
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    lines = []

    @gpumem.find_executable_batch_size(starting_batch_size=4096, log=lines.append)
    def train(batch_size, model):
        opt = torch.optim.AdamW(model.parameters())
        for _ in range(3):
            gpt_step(model, opt, batch_size)
        torch.cuda.synchronize()
        return batch_size

    b = train(model)
    tries = train.tries
    assert tries[0].outcome == "oom" and tries[-1].fits and b == tries[-1].batch_size < 4096
    assert len(lines) == len(tries)
    # fewer tries than 0.9x steps from 4096 down to b would take
    blind, n = 4096, 1
    while blind > b:
        blind, n = int(blind * 0.9), n + 1
    assert len(tries) <= n
    import gc

    gc.collect()
    assert torch.cuda.memory_allocated() <= base + (4 << 20)  # the tries' memory is gone

    calls = []

    @gpumem.find_executable_batch_size(starting_batch_size=100000, verbose=False,
                                       probe=dict(model=model, shape=(SEQ,), dtype=torch.long,
                                                  input_range=(0, VOCAB), autocast=torch.bfloat16,
                                                  max_memory=CAP - (256 << 20)))
    def train2(batch_size):
        calls.append(batch_size)
        return train.__wrapped__(batch_size, model)

    assert train2() == calls[-1] and len(calls) == 1  # gpumem's answer ran at once


def test_decorator_never_retries_a_non_oom_error():
    import torch

    import gpumem

    calls = []

    @gpumem.find_executable_batch_size(starting_batch_size=64, verbose=False)
    def f(batch_size):
        calls.append(batch_size)
        return torch.ones(batch_size, 3, device="cuda") @ torch.ones(4, 5, device="cuda")

    with pytest.raises(RuntimeError, match="shapes"):
        f()
    assert calls == [64]


# ----------------------------------------------------------------------------- Lightning


def _lightning_module(pl, torch):
    from torch.utils.data import DataLoader, Dataset

    class Indices(Dataset):
        def __len__(self):
            return 1 << 20

        def __getitem__(self, i):
            return i

    class LM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = small_gpt()
            self.batch_size = 2

        def train_dataloader(self):
            return DataLoader(Indices(), batch_size=self.batch_size)

        def training_step(self, idx, _):
            import torch.nn.functional as F

            ids = torch.randint(0, VOCAB, (idx.shape[0], SEQ), device=self.device)
            return F.cross_entropy(self.net(ids).flatten(0, 1), ids.flatten())

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters())

    return LM


def test_lightning_callback_beats_power_scaling(tmp_path):
    pl = pytest.importorskip("lightning.pytorch")
    import torch

    import gpumem

    LM = _lightning_module(pl, torch)

    def trainer(cbs):
        return pl.Trainer(accelerator="gpu", devices=1, precision="bf16-mixed", max_steps=3, logger=False,
                          enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                          default_root_dir=str(tmp_path), callbacks=cbs, limit_val_batches=0)

    theirs = LM()
    power = pl.callbacks.BatchSizeFinder(mode="power", steps_per_trial=3)
    trainer([power]).fit(theirs)
    theirs_size = theirs.batch_size
    del theirs, power  # their model and optimizer state would take memory from ours
    import gc

    gc.collect()
    torch.cuda.empty_cache()
    ours = LM()
    finder = gpumem.BatchSizeFinder(steps_per_trial=3, max_val=1 << 16)
    t = trainer([finder])
    t.fit(ours)  # the search, then 3 real steps at the size found: no OOM
    assert t.global_step == 3
    assert ours.batch_size == finder.optimal_batch_size == finder.result.batch_size
    assert ours.batch_size >= theirs_size  # power of two below the max, or the max itself
    assert finder.result.reserved_after <= finder.result.reserved_before


# ----------------------------------------------------------------------------- Hugging Face Trainer


def _hf_trainer(tmp_path, **args):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import torch

    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=256, n_layer=4, n_head=4)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).cuda()
    class Tokens(torch.utils.data.Dataset):  # long enough for 8x the largest batch
        def __len__(self):
            return 1 << 17

        def __getitem__(self, i):
            return {"input_ids": [(i * 7 + j) % VOCAB for j in range(SEQ)]}

    ds = Tokens()

    def collate(items):
        ids = torch.tensor([x["input_ids"] for x in items])
        return {"input_ids": ids, "labels": ids.clone()}

    targs = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=3,
                                           report_to=[], save_strategy="no", bf16=True,
                                           remove_unused_columns=False, **args)
    return transformers.Trainer(model=model, args=targs, train_dataset=ds, data_collator=collate)


def test_hf_trainer_path(tmp_path):
    import gpumem

    tr = _hf_trainer(tmp_path, auto_find_batch_size=True)
    lines = []
    res = gpumem.find_trainer_batch_size(tr, max_memory=CAP - (512 << 20), log=lines.append)
    assert tr.args.per_device_train_batch_size == res.batch_size > 2
    tr.train()  # 3 steps at the size found, through gpumem's decorator (auto_find_batch_size)
    assert tr.state.global_step == 3
    tries = [line for line in lines if "find_executable_batch_size" in line]
    assert len(tries) == 1 and "fits" in tries[0]
    # far too large a size: gpumem's decorator shrinks it on OOM, frees the failed run, finishes
    tr2 = _hf_trainer(tmp_path / "big", auto_find_batch_size=True)
    gpumem.find_trainer_batch_size(tr2, max_memory=CAP - (512 << 20), log=lines.append)
    tr2.args.per_device_train_batch_size = tr2._train_batch_size = 8 * res.batch_size
    lines.clear()
    tr2.train()
    tries = [line for line in lines if "find_executable_batch_size" in line]
    assert "OOM" in tries[0] and "fits" in tries[-1] and tr2.state.global_step == 3


# ----------------------------------------------------------------------------- generate, lengths


def test_generate_mode_needs_less_than_the_prompt_probe_says():
    transformers = pytest.importorskip("transformers")
    import torch

    import gpumem

    # The KV cache of 224 positions (4 layers x 2 x 512 x bf16: about 1.8 MiB a sample) outweighs the
    # prompt's logits. Few layers: every trial's batch gives every token new shapes, and the kernels'
    # choice for each new shape costs more than the tiny model's compute.
    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=512, n_embd=512, n_layer=4, n_head=8)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).cuda().eval()
    kw = dict(input_range=(0, VOCAB), max_memory=512 << 20, autocast=torch.bfloat16, verify_steps=1)
    gen = gpumem.find_batch_size(model, (32,), mode="generate", max_new_tokens=192, **kw)
    prompt_only = gpumem.find_batch_size(model, (32,), mode="inference", dtype=torch.long, **kw)
    assert 1 <= gen.batch_size < prompt_only.batch_size  # the cache grows: the prompt alone over-estimates
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        ids = torch.randint(0, VOCAB, (gen.batch_size, 32), device="cuda")
        out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), max_new_tokens=192,
                             min_new_tokens=192, do_sample=False, pad_token_id=0)
    assert out.shape == (gen.batch_size, 224)


def test_sequence_length_search_and_frontier():
    import torch

    import gpumem

    model = small_gpt()
    kw = dict(dtype=torch.long, input_range=(0, VOCAB), autocast=torch.bfloat16, max_memory=2 << 30,
              verbose=False)
    res = gpumem.find_max_length(model, (16384,), batch_size=2, **kw)
    assert res.searched == "length" and 1 <= res.size < 16384
    opt = torch.optim.AdamW(model.parameters())
    for _ in range(3):
        gpt_step(model, opt, 2, seq=res.size)  # the answer runs
    del opt
    front = gpumem.find_token_frontier(model, (16384,), lengths=[1024, 512, 256], **kw)
    (n1, b1, _), (n2, b2, _), (n3, b3, _) = front.points
    assert (n1, n2, n3) == (1024, 512, 256) and 1 <= b1 <= b2 <= b3
    assert front.max_tokens_per_step == min(n1 * b1, n2 * b2, n3 * b3)
