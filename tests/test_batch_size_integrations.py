"""CPU tests of the trainer integrations with the real libraries: gpumem.BatchSizeFinder and
gpumem.scale_batch_size in a real Lightning Trainer, gpumem.find_trainer_batch_size on a real
Hugging Face Trainer (a tiny GPT-2 built from its config).  The trainers' own loops and steps run
on the CPU; only the device memory is simulated (the search's backend, as in
tests/test_batch_size.py), since a CPU has none to run out of.  Skipped where a library is missing."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from sim_memory import SimBackend  # tests/sim_memory.py

import gpumem
from gpumem import batch_size as bs

# The libraries' own deprecation warnings against this torch (e.g. Lightning's use of
# torch.utils._pytree.LeafSpec) are theirs, not gpumem's: not errors here.
pytestmark = [pytest.mark.filterwarnings("ignore::FutureWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::UserWarning")]

MiB = 1 << 20
GiB = 1 << 30
LIMIT = 2 * GiB


def curve(b):
    return 100 * MiB + b * MiB


def expected_max():
    from gpumem.batch_size.verify import floor_bytes

    target = LIMIT - floor_bytes(LIMIT)
    return (target - 100 * MiB) // MiB


def simulated_find(backends):
    """find_batch_size on the CPU: the real search and state guard, memory simulated."""

    def find(model, shape=None, **kw):
        args = dict(mode="train", dtype=None, input_range=None, input_fn=None, step_fn=None, loss_fn=None,
                    optimizer=None, autocast=None, max_memory=None, margin=None, resolution=None, min_batch=1,
                    max_batch=None, steps=3, target_batch=None, log=None, distributed=None, verbose=False,
                    verify_steps=5)
        args.update(kw)
        backend = SimBackend(curve, LIMIT, oom_request="2.00 MiB")
        backends.append(backend)
        return bs._find(model, shape, backend=backend, **args)

    return find


# ----------------------------------------------------------------------------- Lightning


def lightning_parts():
    pl = pytest.importorskip("lightning.pytorch")
    from torch.utils.data import DataLoader, TensorDataset

    data = TensorDataset(torch.randn(4096, 8), torch.randint(0, 2, (4096,)))

    class LM(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Linear(8, 2)
            self.batch_size = 2
            self.seen = []

        def train_dataloader(self):
            return DataLoader(data, batch_size=self.batch_size, drop_last=True)

        def training_step(self, batch, _):
            x, y = batch
            self.seen.append(x.shape[0])
            return F.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    class DM(pl.LightningDataModule):
        def __init__(self):
            super().__init__()
            self.batch_size = 4

        def train_dataloader(self):
            return DataLoader(data, batch_size=self.batch_size, drop_last=True)

    return pl, LM, DM


def trainer(pl, tmp_path, callbacks=(), **kw):
    return pl.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(tmp_path),
                      callbacks=list(callbacks), **kw)


@pytest.fixture
def lightning_sim(monkeypatch):
    from gpumem.batch_size import lightning as lmod

    backends = []
    monkeypatch.setattr(lmod, "find_batch_size", simulated_find(backends))
    return backends


def test_lightning_callback_sets_the_models_batch_size(tmp_path, lightning_sim):
    pl, LM, _ = lightning_parts()
    lm = LM()
    w0 = lm.net.weight.detach().clone()
    finder = gpumem.BatchSizeFinder(steps_per_trial=2, verbose=False)
    assert isinstance(finder, pl.callbacks.BatchSizeFinder)  # Lightning's callback, the same hooks
    t = trainer(pl, tmp_path, [finder])
    t.fit(lm)
    best = expected_max()
    assert 0.98 * best <= lm.batch_size <= best
    assert finder.optimal_batch_size == lm.batch_size and finder.result.batch_size == lm.batch_size
    # the trials were Lightning's own loop at each size (steps_per_trial steps each)
    tried = [t.batch_size for t in finder.result.trials]
    assert lightning_sim[0].begun == tried
    for b in set(tried):
        assert lm.seen.count(b) >= 2
    # then the real training ran at the size found, from the state before the search
    assert lm.seen[-4:] == [lm.batch_size] * 4
    assert t.global_step == 4
    assert not torch.equal(lm.net.weight.detach(), w0)  # trained (4 steps), after the state was restored


def test_lightning_callback_datamodule_and_target_batch(tmp_path, lightning_sim):
    pl, LM, DM = lightning_parts()

    class NoAttr(LM):
        def __init__(self):
            super().__init__()
            del self.batch_size

        def train_dataloader(self):
            return self.trainer.datamodule.train_dataloader()

    lm, dm = NoAttr(), DM()
    finder = gpumem.BatchSizeFinder(steps_per_trial=1, target_batch=3000, verbose=False)
    t = trainer(pl, tmp_path, [finder])
    t.fit(lm, datamodule=dm)
    micro, steps = dm.batch_size, t.accumulate_grad_batches
    assert micro * steps >= 3000 and micro <= expected_max() and steps == finder.accumulation_steps == 2
    assert not hasattr(lm, "batch_size")


def test_lightning_scale_batch_size_like_the_tuner(tmp_path, lightning_sim):
    pl, LM, _ = lightning_parts()
    lm = LM()
    t = trainer(pl, tmp_path)
    size = gpumem.scale_batch_size(t, lm, steps_per_trial=1, verbose=False)
    assert size == lm.batch_size and 0.98 * expected_max() <= size <= expected_max()
    assert t.global_step == 0  # the Tuner stops after the search: no training ran
    assert not any(isinstance(cb, gpumem.BatchSizeFinder) for cb in t.callbacks)


def test_lightning_callback_argument_checks():
    lightning_parts()
    with pytest.raises(ValueError, match="init_val"):
        gpumem.BatchSizeFinder(init_val=0)
    with pytest.raises(ValueError, match="max_val"):
        gpumem.BatchSizeFinder(init_val=8, max_val=4)


# ----------------------------------------------------------------------------- Hugging Face Trainer


def hf_trainer(tmp_path, **args):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    cfg = transformers.GPT2Config(vocab_size=64, n_positions=32, n_embd=16, n_layer=1, n_head=2)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg)
    ds = [{"input_ids": [i % 64] * (8 + i % 9), "labels": [i % 64] * (8 + i % 9)} for i in range(40)]

    def collate(items):  # pads to the longest of the batch, as padding collators do
        n = max(len(x["input_ids"]) for x in items)
        ids = torch.tensor([x["input_ids"] + [0] * (n - len(x["input_ids"])) for x in items])
        return {"input_ids": ids, "labels": ids.clone()}

    targs = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=1,
                                           report_to=[], use_cpu=True, save_strategy="no",
                                           remove_unused_columns=False, **args)
    return transformers, transformers.Trainer(model=model, args=targs, train_dataset=ds, data_collator=collate)


@pytest.fixture
def hf_sim(monkeypatch):
    from gpumem.batch_size import hf

    backends = []
    monkeypatch.setattr(hf, "find_batch_size", simulated_find(backends))
    return backends


def test_hf_trainer_batch_size_set_from_its_own_step(tmp_path, hf_sim):
    _, tr = hf_trainer(tmp_path)
    shapes = []
    tr.model.register_forward_pre_hook(lambda m, a, kw: shapes.append(tuple(kw["input_ids"].shape)),
                                       with_kwargs=True)
    res = gpumem.find_trainer_batch_size(tr, verbose=False, steps=1, verify_steps=1)
    best = expected_max()
    assert 0.98 * best <= res.batch_size <= best
    assert tr.args.per_device_train_batch_size == res.batch_size == tr._train_batch_size
    # the trainer's step ran at each trial size, on batches of its longest sample (16 tokens)
    assert [s[0] for s in shapes] == [t.batch_size for t in res.trials]
    assert all(s[1] == 16 for s in shapes)
    assert all(p.grad is None for p in tr.model.parameters())  # the state was restored


def test_hf_trainer_target_batch_and_auto_find_batch_size(tmp_path, hf_sim, monkeypatch):
    transformers, tr = hf_trainer(tmp_path, auto_find_batch_size=True)
    import transformers.trainer as tt

    from gpumem.batch_size import hf

    monkeypatch.setattr(tt, "find_executable_batch_size", tt.find_executable_batch_size)  # restored after
    monkeypatch.setattr(hf, "_original", {})
    lines = []
    res = gpumem.find_trainer_batch_size(tr, target_batch=5000, steps=1, verify_steps=1, log=lines.append)
    assert tr.args.per_device_train_batch_size == res.micro_batch_size
    assert tr.args.gradient_accumulation_steps == res.accumulation_steps
    assert res.micro_batch_size * res.accumulation_steps >= 5000
    # this trainer's train() now retries through gpumem's decorator, starting at the size found
    wrapped = tt.find_executable_batch_size(tr._inner_training_loop, 7, True)
    assert hasattr(wrapped, "tries")
    _, other = hf_trainer(tmp_path / "other", auto_find_batch_size=True)
    assert not hasattr(tt.find_executable_batch_size(other._inner_training_loop, 7, True), "tries")
    # a real (CPU) training run through it: one try, at the trainer's batch size
    tr.args.per_device_train_batch_size = tr._train_batch_size = 4
    tr.args.gradient_accumulation_steps = 1
    lines.clear()
    tr.train()
    assert tr.state.global_step == 1
    tries = [line for line in lines if "find_executable_batch_size" in line]
    assert len(tries) == 1 and "fits" in tries[0] and "batch       4" in tries[0]


def test_lightning_predict_trials_are_limited_to_steps_per_trial(tmp_path, lightning_sim):
    # Lightning's own reset does not limit the prediction loop; the gpumem callback does
    pl, LM, _ = lightning_parts()
    from torch.utils.data import DataLoader, TensorDataset

    class P(LM):
        def predict_dataloader(self):
            return DataLoader(TensorDataset(torch.randn(1 << 16, 8)), batch_size=self.batch_size)

        def predict_step(self, batch, _):
            self.seen.append(batch[0].shape[0])

    lm = P()
    t = trainer(pl, tmp_path)
    size = gpumem.scale_batch_size(t, lm, method="predict", steps_per_trial=2, verbose=False)
    res = gpumem.scale_batch_size.last_finder.result
    assert size == lm.batch_size and 0.98 * expected_max() <= size <= expected_max()
    assert len(lm.seen) == 2 * len(res.trials)  # two batches per trial, not the whole dataset
    assert t.limit_predict_batches == 1.0  # put back
