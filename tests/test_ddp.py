"""AttentionMonitor under DDP (CPU, gloo, 2 processes) against a single-process run over the same samples.

Spawned ranks return nothing to the test process but the weights, so the checks that need the computed
``AttentionStats`` run inside ``on_validation_epoch_end`` of every rank (``Checked``), against a reference the
single-process run saved first; each rank leaves a marker file per epoch so the test knows the checks really ran.
Everything a spawned rank unpickles lives at module level.
"""

import os
import subprocess
import sys
from collections import Counter
from datetime import timedelta
from pathlib import Path
from unittest import mock

import pytest
import torch
import torch.distributed as dist
from _callback_helpers import TinyEncoder, make_batches
from _reference import copied, returned
from lightning.pytorch import LightningModule, Trainer, seed_everything
from lightning.pytorch.loggers import TensorBoardLogger
from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy, ModelParallelStrategy
from tensorboard.backend.event_processing.event_accumulator import IMAGES, SCALARS, TENSORS, EventAccumulator
from torch import nn
from torch.utils.data import DataLoader

from attn_callbacks import AttentionMonitor, load_epoch

VOCAB, PAD, MUTE, LENGTH, DIM = 10, 0, 1, 6, 8  # MUTE: never a key for the model's `mix` attention
EPOCHS, WORLD, VAL_BATCH, TRAIN_BATCH = 2, 2, 2, 2  # TRAIN_BATCH per rank; the single process takes WORLD times more
N_VAL, N_TRAIN = 16, 8  # N_VAL divides by WORLD * VAL_BATCH: DistributedSampler pads nothing
FIELDS = ("attention_sum", "pair_count", "query_count", "uniform_sum", "position_sums", "skipped_rows")
LAYERS = ("encoder.self_attn", "mix")
DDP_ENV = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "GLOBAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")


def val_samples():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(MUTE + 1, VOCAB, (N_VAL, LENGTH), generator=g)
    ids[::3, -2:] = PAD  # padded queries and keys, left out of the sums
    ids[1::4, 1] = MUTE  # a query the `mix` module does not let be a key
    ids[3, :4] = MUTE  # two samples, one for each rank, where `mix` sees no key at all: NaN rows, skipped_rows
    ids[8, :] = MUTE
    return [{"input_ids": row} for row in ids]


def train_samples():
    # One sequence, repeated: Lightning's DistributedSampler shuffles training data whatever the loader says, and
    # with equal samples every rank's batch is the single process's batch, so each SGD step is the same in both runs.
    ids = torch.randint(MUTE + 1, VOCAB, (LENGTH,), generator=torch.Generator().manual_seed(2))
    return [{"input_ids": ids.clone()} for _ in range(N_TRAIN)]


def loaders(world_size):
    """Unshuffled validation: DistributedSampler hands rank r the samples r, r + 2, ... and pads nothing."""
    train = DataLoader(train_samples(), batch_size=TRAIN_BATCH * (WORLD // world_size))
    return train, DataLoader(val_samples(), batch_size=VAL_BATCH)


class TinyModel(LightningModule):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.encoder = nn.TransformerEncoderLayer(DIM, 2, dim_feedforward=16, dropout=0.0, batch_first=True)
        self.mix = nn.MultiheadAttention(DIM, 2, dropout=0.0, batch_first=True)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, ids):
        x = self.encoder(self.embed(ids), src_key_padding_mask=ids == PAD)
        y, _ = self.mix(x, x, x, key_padding_mask=(ids == PAD) | (ids == MUTE))
        return self.head(x + y.nan_to_num())  # rows with no key are NaN

    def training_step(self, batch, batch_idx):
        ids = batch["input_ids"]
        return nn.functional.cross_entropy(self(ids).flatten(0, 1), ids.flatten())

    def validation_step(self, batch, batch_idx):
        self(batch["input_ids"])

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.5)


class ShardedModel(TinyModel):
    """TinyModel sharded with FSDP2 (``fully_shard``) over ``ModelParallelStrategy``'s data-parallel mesh."""

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        mesh = self.device_mesh["data_parallel"]
        for module in (self.encoder, self.mix):
            fully_shard(module, mesh=mesh)
        fully_shard(self, mesh=mesh)

    def validation_step(self, batch, batch_idx):
        assert type(self.mix).__name__ == "FSDPMultiheadAttention"  # really sharded (FSDP2 swaps the class)
        super().validation_step(batch, batch_idx)


class SdpaMix(nn.Module):
    """``mix`` as a module calling ``scaled_dot_product_attention`` (2 heads; PAD and MUTE keys masked)."""

    def __init__(self):
        super().__init__()
        self.qkv, self.out = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)

    def forward(self, x, ids):
        b_, length, _ = x.shape
        # (B, 2, L, 4) each
        q, k, v = (t.view(b_, length, 2, DIM // 2).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
        allowed = ((ids != PAD) & (ids != MUTE))[:, None, None, :]  # (B, 1, 1, L)
        y = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        return self.out(y.transpose(1, 2).reshape(b_, length, DIM))


class SdpaModel(TinyModel):
    """TinyModel whose ``mix`` calls SDPA: its sums are allocated at the first call, on every rank."""

    def __init__(self):
        super().__init__()
        self.mix = SdpaMix()

    def forward(self, ids):
        x = self.encoder(self.embed(ids), src_key_padding_mask=ids == PAD)
        return self.head(x + self.mix(x, ids).nan_to_num())


def make_model(kind="mha"):
    seed_everything(0)
    return {"mha": TinyModel, "fsdp2": ShardedModel, "sdpa": SdpaModel}[kind]()


class Checked(AttentionMonitor):
    """Records (``reference`` given as None) or checks against ``reference/epoch{e}.pt`` the stats it computed.

    Checking runs on every rank inside ``on_validation_epoch_end``: the stats equal the reference, and the stats of
    all ranks equal each other; then ``{out}/rank{r}_epoch{e}.ok`` is written and the stats saved next to it.
    """

    def __init__(self, out, reference=None, export=None):
        super().__init__(
            VOCAB,
            "input_ids",
            ignore_ids=[PAD],
            top_k=VOCAB,
            min_support=1,
            entropy_collapse_threshold=0,
            export=export,
        )
        self.out, self.reference = str(out), None if reference is None else str(reference)

    def on_validation_epoch_start(self, trainer, pl_module):
        self.seen = {}
        super().on_validation_epoch_start(trainer, pl_module)

    def on_validation_epoch_end(self, trainer, pl_module):
        def keep(result):
            self.seen.update({name: copied(stats) for name, stats in result[1].items()})

        with returned(self._sums, "collect", keep):
            super().on_validation_epoch_end(trainer, pl_module)
        epoch, rank = trainer.current_epoch, trainer.global_rank
        stats = {name: {field: getattr(s, field).detach().cpu() for field in FIELDS} for name, s in self.seen.items()}
        assert sorted(stats) == sorted(LAYERS), sorted(stats)
        if self.reference is None:
            assert trainer.world_size == 1
            torch.save(stats, Path(self.out) / f"epoch{epoch}.pt")
            return
        assert trainer.world_size == WORLD
        expected = torch.load(Path(self.reference) / f"epoch{epoch}.pt")
        for name in LAYERS:
            for field in FIELDS:
                actual, want = stats[name][field], expected[name][field]
                if want.is_floating_point():
                    torch.testing.assert_close(
                        actual, want, rtol=1e-6, atol=1e-6, msg=lambda m, n=name, f=field: f"{n} {f}: {m}"
                    )
                else:  # counts: exact, and a sum over ranks, not one rank's share nor twice the total
                    assert torch.equal(actual, want), f"{name} {field}: {actual} != {want}"
        everyone = [None] * WORLD
        dist.all_gather_object(everyone, stats)
        for other in everyone:
            for name in LAYERS:
                for field in FIELDS:
                    assert torch.equal(other[name][field], stats[name][field]), f"ranks differ on {name} {field}"
        torch.save(stats, Path(self.out) / f"rank{rank}_epoch{epoch}.pt")
        (Path(self.out) / f"rank{rank}_epoch{epoch}.ok").touch()


def fit(root, strategy, devices, reference=None, export=None, kind="mha"):
    """Fit 2 epochs from the same seeded weights; TensorBoard events go to ``root/tb/version_0``.

    ``strategy`` "ddp_spawn" or "ddp" with a short collective timeout: a rank left waiting in a collective (say,
    ``compute()`` called on one rank only) fails the test in a minute instead of hanging CI for half an hour.
    """
    root = Path(root)
    sharded = strategy == "fsdp2"
    if strategy in ("ddp_spawn", "ddp"):  # the registry's "ddp_spawn" is DDPStrategy(start_method="spawn")
        start = "spawn" if strategy == "ddp_spawn" else "popen"
        strategy = DDPStrategy(start_method=start, process_group_backend="gloo", timeout=timedelta(seconds=60))
    elif sharded:
        strategy = ModelParallelStrategy(
            data_parallel_size=devices,
            tensor_parallel_size=1,
            process_group_backend="gloo",
            timeout=timedelta(seconds=60),
        )
    (root / "out").mkdir(parents=True, exist_ok=True)
    trainer = Trainer(
        default_root_dir=root,
        accelerator="cpu",
        strategy=strategy,
        devices=devices,
        max_epochs=EPOCHS,
        num_sanity_val_steps=0,
        logger=TensorBoardLogger(root, name="tb", version=0),
        callbacks=[Checked(root / "out", reference, export)],
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    with mock.patch.dict(os.environ):  # the spawn launcher sets MASTER_PORT here: keep it out of later tests
        trainer.fit(make_model("fsdp2" if sharded else kind), *loaders(devices))


def events(root):
    accumulator = EventAccumulator(
        str(Path(root) / "tb" / "version_0"), size_guidance={IMAGES: 0, SCALARS: 0, TENSORS: 0}
    )
    accumulator.Reload()
    return accumulator


def scalars(accumulator):
    return {
        tag: [(e.step, e.value) for e in accumulator.Scalars(tag)]
        for tag in accumulator.Tags()["scalars"]
        if tag.startswith("attention")
    }


def assert_markers(out):
    for rank in range(WORLD):
        for epoch in range(EPOCHS):
            assert (Path(out) / f"rank{rank}_epoch{epoch}.ok").exists(), f"checks did not run on rank {rank}, {epoch=}"
    for epoch in range(EPOCHS):
        first, second = (torch.load(Path(out) / f"rank{r}_epoch{epoch}.pt") for r in range(WORLD))
        assert all(torch.equal(first[n][f], second[n][f]) for n in LAYERS for f in FIELDS)


def assert_scalars_match(reference_root, ddp_root):
    want, got = scalars(events(reference_root)), scalars(events(ddp_root))
    assert sorted(got) == sorted(want)
    for layer in LAYERS:
        for tag in (
            f"attention_drift/{kind}_{which}/{layer}" for kind in ("js", "frobenius") for which in ("prev", "ref")
        ):
            assert len(want[tag]) == 1 and want[tag][0][1] > 1e-4, (tag, want[tag])  # the model moved: a real drift
        skipped = f"attention_skipped_rows/{layer}"
        assert [v for _, v in want[skipped]] == ([10.0] * EPOCHS if layer == "mix" else [0.0] * EPOCHS)
    for tag, values in want.items():
        assert [s for s, _ in got[tag]] == [s for s, _ in values], tag
        # equal, not 2x (summed twice) nor 1/2 (one rank's share)
        torch.testing.assert_close([v for _, v in got[tag]], [v for _, v in values], rtol=1e-5, atol=1e-6, msg=tag)


@pytest.fixture(scope="module")
def spawn_runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp_spawn")
    fit(root / "single", "auto", 1)
    fit(root / "ddp", "ddp_spawn", WORLD, reference=root / "single" / "out")
    return root / "single", root / "ddp"


def test_ddp_spawn_stats_equal_single_process_on_every_rank(spawn_runs):
    single, ddp = spawn_runs
    assert sorted(p.name for p in (single / "out").iterdir()) == [f"epoch{e}.pt" for e in range(EPOCHS)]
    for epoch in range(EPOCHS):  # nothing vacuous compared: every sum is non-zero somewhere
        reference = torch.load(single / "out" / f"epoch{epoch}.pt")
        assert all(reference[n][f].abs().sum() > 0 for n in LAYERS for f in FIELDS if f != "skipped_rows")
        assert int(reference["mix"]["skipped_rows"]) == 10 and int(reference["encoder.self_attn"]["skipped_rows"]) == 0
    assert_markers(ddp / "out")


def test_ddp_spawn_scalars_and_drift_equal_single_process_not_double_counted(spawn_runs):
    assert_scalars_match(*spawn_runs)


def test_ddp_spawn_images_and_text_written_by_global_rank_zero_only(spawn_runs):
    single, ddp = spawn_runs
    files = sorted(ddp.rglob("events.out.tfevents.*"))
    assert len(files) == 1, files  # one writer: rank 1's experiment is a dummy
    want, got = events(single), events(ddp)
    assert sorted(got.Tags()["images"]) == sorted(want.Tags()["images"])
    assert sorted(got.Tags()["tensors"]) == sorted(want.Tags()["tensors"])  # add_text tables
    grids = [tag for tag in got.Tags()["images"] if tag.startswith("attention_heads/")]
    assert len(got.Tags()["images"]) - len(grids) == len(LAYERS) * 5  # mass, mass_heads, asymmetry, lift, drift maps
    assert len(grids) == 13  # entropy, asymmetry, lift, 6 position statistics, 4 drift
    for tag in got.Tags()["images"]:
        steps = [e.step for e in got.Images(tag)]
        assert steps == [e.step for e in want.Images(tag)], tag
        assert len(steps) == (EPOCHS - 1 if "drift" in tag else EPOCHS) and max(Counter(steps).values()) == 1
    for tag in got.Tags()["tensors"]:
        steps = [e.step for e in got.Tensors(tag)]
        assert steps == [e.step for e in want.Tensors(tag)] and max(Counter(steps).values()) == 1, tag


def relaunched(root, single, strategy):
    """Fit with ``strategy`` ("ddp", "fsdp2") from this module run as a script: those launchers re-run the launching
    script for rank 1, which must never be the pytest process. Fails with the script's output."""
    env = {k: v for k, v in os.environ.items() if k not in DDP_ENV}
    result = subprocess.run(
        [sys.executable, os.path.abspath(__file__), str(root), str(single / "out"), strategy],
        env=env,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]


def test_ddp_subprocess_launcher_matches_single_process(spawn_runs, tmp_path):
    """strategy="ddp" re-runs the launching script for rank 1, so it runs in a script of its own (this module
    run as ``__main__``), never in the pytest process, which rank 1 would otherwise re-run."""
    single, _ = spawn_runs
    relaunched(tmp_path, single, "ddp")
    assert_markers(tmp_path / "out")
    assert_scalars_match(single, tmp_path)
    assert len(list(tmp_path.rglob("events.out.tfevents.*"))) == 1


def test_ddp_spawn_export_saves_every_epoch_once_with_the_summed_stats(spawn_runs, tmp_path):
    """export="pt" without export_dir: the folder comes from ``trainer.log_dir``, a collective that every rank must
    call, even though only global rank 0 writes; one file per epoch, holding the sums over both ranks."""
    single, _ = spawn_runs
    fit(tmp_path, "ddp_spawn", WORLD, reference=single / "out", export="pt")
    assert_markers(tmp_path / "out")
    files = sorted(tmp_path.rglob("*.pt"))
    exported = [f for f in files if f.parent.name == "attention_epochs"]
    assert [f.parent for f in exported] == [tmp_path / "tb" / "version_0" / "attention_epochs"] * EPOCHS, files
    for epoch, path in enumerate(exported):
        record = load_epoch(path)
        assert record.epoch == epoch and sorted(record.modules) == sorted(LAYERS)
        expected = torch.load(single / "out" / f"epoch{epoch}.pt")
        for name in LAYERS:
            for field in FIELDS:
                got = getattr(record.modules[name], field)
                torch.testing.assert_close(got, expected[name][field], rtol=1e-6, atol=1e-6, msg=f"{name} {field}")


def test_ddp_spawn_sdpa_sums_allocated_at_the_first_call_equal_single_process(tmp_path):
    """A module calling SDPA gets its sums at its first call, on each rank; the ranks agree on them before summing."""
    fit(tmp_path / "single", "auto", 1, kind="sdpa")
    fit(tmp_path / "ddp", "ddp_spawn", WORLD, reference=tmp_path / "single" / "out", kind="sdpa")
    assert_markers(tmp_path / "ddp" / "out")
    assert_scalars_match(tmp_path / "single", tmp_path / "ddp")


def test_fsdp2_model_parallel_strategy_matches_single_process(spawn_runs, tmp_path):
    """``ModelParallelStrategy`` with FSDP2's ``fully_shard`` (2 gloo ranks on the CPU) re-runs the launching script
    like strategy="ddp": the same sums on every rank as one process, and the same, clean, module names."""
    single, _ = spawn_runs
    relaunched(tmp_path, single, "fsdp2")
    assert_markers(tmp_path / "out")  # every rank checked its sums and names (LAYERS) against the single process
    assert_scalars_match(single, tmp_path)


if __name__ == "__main__":  # rank 0 of the subprocess-launched tests above, and rank 1 re-run
    fit(sys.argv[1], sys.argv[3], WORLD, reference=sys.argv[2])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="Lightning's FSDPStrategy needs a CUDA device")
def test_fsdp_strategy_on_one_gpu_logs_the_plain_models_values(tmp_path):
    """FSDP (v1) wrapping each encoder layer: the same scalars under the same tags (no ``_fsdp_wrapped_module``)."""
    logged = {}
    for name, strategy in (("plain", "auto"), ("fsdp", FSDPStrategy(auto_wrap_policy={nn.TransformerEncoderLayer}))):
        torch.manual_seed(0)
        monitor = AttentionMonitor(vocab_size=12, ignore_ids=[0], num_pairs=0, top_k=5)
        trainer = Trainer(
            default_root_dir=tmp_path, accelerator="gpu", devices=1, strategy=strategy, callbacks=[monitor],
            logger=TensorBoardLogger(tmp_path, name=name), enable_progress_bar=False, enable_model_summary=False,
        )  # fmt: skip
        trainer.validate(TinyEncoder(), DataLoader(make_batches(), batch_size=None), verbose=False)
        events = EventAccumulator(str(tmp_path / name / "version_0"), size_guidance={SCALARS: 0})
        events.Reload()
        logged[name] = {tag: events.Scalars(tag)[-1].value for tag in events.Tags()["scalars"]}
    assert len(logged["plain"]) > 20 and logged["fsdp"].keys() == logged["plain"].keys()
    assert not any("_fsdp_wrapped_module" in tag for tag in logged["fsdp"])
    for tag, value in logged["plain"].items():
        assert logged["fsdp"][tag] == pytest.approx(value, rel=1e-5, abs=1e-6), tag
