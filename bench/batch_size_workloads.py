"""The workloads of bench/batch_size_bench.py: each model, its step, and each finder run on it.

A workload is a kind of loop people run, small enough (under a memory fraction) for the whole
bench to run in minutes:

  resnet  CNN training: ResNet-50 (bench/models.py), 3x96x96 images, SGD with momentum, bf16 autocast.
  gpt     transformer training: the GPT of bench/models.py (d=512, 6 layers, vocab 16000), sequence
          512, AdamW, bf16 autocast.
  bert    encoder inference: BERT-base (transformers' BertModel from its config, fp16), sequence 384.
  gen     decoder generation with a KV cache: GPT-2 (transformers, 4 layers, d=512, fp16), a 32-token
          prompt, 64 new tokens (all of them: min_new_tokens), greedy.
  seqlen  a sequence-length search: the gpt workload at batch 4; the size searched is the length.

``step(b)`` is the definition of "fits" (``steps`` of them in a fresh process); every finder is
given that same step: gpumem through ``step_fn`` (or its built-in mode where that is the same
step: inference, generate, the length search), Lightning as ``training_step`` / ``predict_step``,
Accelerate's decorator as the decorated function.
"""
import torch
import torch.nn.functional as F

from models import GPT, resnet50

# name -> (kind, default memory fraction, Accelerate's starting size, search bound)
SPECS = {
    "resnet": ("train", 0.05, 2048, 1 << 14),
    "gpt": ("train", 0.05, 1024, 1 << 13),
    "bert": ("inference", 0.04, 4096, 1 << 15),
    "gen": ("generate", 0.03, 8192, 1 << 15),
    "seqlen": ("length", 0.05, 65536, 1 << 16),
}
SEQ, VOCAB, BERT_SEQ, PROMPT, NEW_TOKENS, LEN_BATCH = 512, 16000, 384, 32, 64, 4


class Workload:
    def __init__(self, name):
        self.name = name
        self.kind, self.fraction, self.accelerate_start, self.max_size = SPECS[name]
        torch.manual_seed(0)
        if name == "resnet":
            self.model = resnet50(classes=100).cuda()
        elif name in ("gpt", "seqlen"):
            self.model = GPT(vocab=VOCAB, d=512, layers=6, heads=8).cuda()
        elif name == "bert":
            from transformers import BertConfig, BertModel

            self.model = BertModel(BertConfig()).cuda().half().eval()
        else:
            from transformers import GPT2Config, GPT2LMHeadModel

            cfg = GPT2Config(n_layer=4, n_embd=512, n_head=8, n_positions=PROMPT + NEW_TOKENS)
            self.model = GPT2LMHeadModel(cfg).cuda().half().eval()
        self.opt = None

    # -- the step that defines "fits"
    def optimizer(self):
        if self.name == "resnet":
            return torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        return torch.optim.AdamW(self.model.parameters())

    def loss(self, b):
        """(loss, kept): forward and loss of one training batch (b = the length for seqlen). ``kept``
        is what the step keeps referenced through backward and the optimizer step: nothing, except
        for seqlen, whose step is gpumem's built-in one (the logits kept, as hand-written loops do)."""
        if self.name == "resnet":
            x = torch.randn(b, 3, 96, 96, device="cuda")
            y = torch.randint(0, 100, (b,), device="cuda")
            with torch.autocast("cuda", dtype=torch.bfloat16):
                return F.cross_entropy(self.model(x), y), None
        n, bb = (SEQ, b) if self.name == "gpt" else (b, LEN_BATCH)
        ids = torch.randint(0, VOCAB, (bb, n), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            logits = self.model(ids)
            loss = F.cross_entropy(logits.flatten(0, 1), ids.flatten())
        return loss, (logits if self.name == "seqlen" else None)

    def infer(self, b):
        with torch.no_grad():
            if self.name == "bert":
                ids = torch.randint(0, 30522, (b, BERT_SEQ), device="cuda")
                out = self.model(input_ids=ids)
            else:
                ids = torch.randint(0, self.model.config.vocab_size, (b, PROMPT), device="cuda")
                out = self.model.generate(input_ids=ids, attention_mask=torch.ones_like(ids),
                                          max_new_tokens=NEW_TOKENS, min_new_tokens=NEW_TOKENS, do_sample=False,
                                          use_cache=True, pad_token_id=self.model.config.eos_token_id)
        del out

    def step(self, b):
        """One step at size b (a batch, or a length for seqlen); the optimizer persists across steps."""
        if self.kind in ("inference", "generate"):
            return self.infer(b)
        if self.opt is None:
            self.opt = self.optimizer()
        loss, kept = self.loss(b)
        loss.backward()
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        del loss, kept

    def steps(self, b, n):
        self.opt = None
        for _ in range(n):
            self.step(b)
        torch.cuda.synchronize()
        self.opt = None

    # -- the finders
    def gpumem(self, verbose=True):
        import gpumem

        if self.kind == "train":
            self.opt = self.optimizer()
            return gpumem.find_batch_size(self.model, step_fn=self.step, optimizer=self.opt,
                                          max_batch=self.max_size, verbose=verbose)
        if self.kind == "inference":
            return gpumem.find_batch_size(self.model, (BERT_SEQ,), mode="inference", dtype=torch.long,
                                          input_range=(0, 30522), max_batch=self.max_size, verbose=verbose)
        if self.kind == "generate":
            return gpumem.find_batch_size(self.model, (PROMPT,), mode="generate", max_new_tokens=NEW_TOKENS,
                                          input_range=(0, self.model.config.vocab_size),
                                          max_batch=self.max_size, verbose=verbose)
        # the length search: the built-in step is this workload's (logits kept through backward)
        return gpumem.find_max_length(
            self.model, (self.max_size,), batch_size=LEN_BATCH, dtype=torch.long, input_range=(0, VOCAB),
            autocast=torch.bfloat16, optimizer=torch.optim.AdamW,
            loss_fn=lambda out, ids: F.cross_entropy(out.flatten(0, 1), ids.flatten()), verbose=verbose)

    def accelerate(self, start):
        from accelerate.utils import find_executable_batch_size

        tries = []

        @find_executable_batch_size(starting_batch_size=start)
        def run(b):
            tries.append(b)
            self.steps(b, 3)
            return b

        return run(), len(tries)

    def gpumem_decorator(self, start):
        import gpumem

        @gpumem.find_executable_batch_size(starting_batch_size=start)
        def run(b):
            self.steps(b, 3)
            return b

        return run(), len(run.tries)

    def lightning(self, mode):
        import tempfile

        try:
            import lightning.pytorch as pl
            from lightning.pytorch.tuner import Tuner
        except ImportError:
            import pytorch_lightning as pl
            from pytorch_lightning.tuner import Tuner
        from torch.utils.data import DataLoader, Dataset

        work = self
        arg = "seq_len" if self.kind == "length" else "batch_size"

        class Indices(Dataset):
            """Only indices travel through the loader; the batch is made on the GPU (no loader cost)."""

            def __len__(self):
                return 10 ** 7

            def __getitem__(self, i):
                return i

        class LM(pl.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = work.model
                setattr(self, arg, 2)
                self.trials = 0

            def _loader(self):
                self.trials += 1
                return DataLoader(Indices(), batch_size=LEN_BATCH if arg == "seq_len" else self.batch_size)

            def train_dataloader(self):
                return self._loader()

            def val_dataloader(self):
                return self._loader()

            def training_step(self, idx, _):
                # the same step as the other finders' (kept: referenced until the optimizer stepped)
                loss, self.kept = work.loss(idx.shape[0] if arg == "batch_size" else self.seq_len)
                return loss

            def on_train_batch_end(self, *args):
                self.kept = None

            def validation_step(self, idx, _):
                # validate, not predict: Lightning's finder limits the evaluation loops to
                # steps_per_trial batches, but not the prediction loop (it would run the whole dataset)
                work.infer(idx.shape[0])

            def configure_optimizers(self):
                return work.optimizer()

        lm = LM()
        training = self.kind in ("train", "length")
        with tempfile.TemporaryDirectory() as d:
            trainer = pl.Trainer(accelerator="gpu", devices=1, max_epochs=1, logger=False, enable_checkpointing=False,
                                 enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                                 default_root_dir=d, **({"limit_val_batches": 0} if training else {}))
            method = "fit" if training else "validate"
            size = Tuner(trainer).scale_batch_size(lm, method=method, mode=mode, steps_per_trial=3, init_val=2,
                                                   max_trials=25, batch_arg_name=arg,
                                                   **({"max_val": self.max_size} if _has_max_val(Tuner) else {}))
        self.model.cuda()  # Lightning's checkpoint restore can leave the model elsewhere
        return int(size), lm.trials


def _has_max_val(tuner):
    import inspect

    return "max_val" in inspect.signature(tuner.scale_batch_size).parameters

