"""The private attribute of Lightning that attn_callbacks/base/private_api.py reads, checked against the installed
version: when a release changes it, this fails here first."""

from lightning.pytorch import Trainer
from lightning.pytorch.demos.boring_classes import BoringModel
from lightning.pytorch.loggers import CSVLogger

from attn_callbacks.base.private_api import epoch_end_step


def test_epoch_end_step_is_the_step_lightning_logs_epoch_metrics_at(tmp_path):
    steps = []

    class Model(BoringModel):
        def on_validation_epoch_end(self):
            self.log("probe", 1.0)
            steps.append(epoch_end_step(self.trainer))

    logger = CSVLogger(tmp_path)
    trainer = Trainer(
        max_epochs=2, limit_train_batches=3, limit_val_batches=1, logger=logger, enable_progress_bar=False,
        enable_checkpointing=False, enable_model_summary=False, num_sanity_val_steps=0,
    )  # fmt: skip
    trainer.fit(Model())
    logged = [line.split(",") for line in (tmp_path / "lightning_logs/version_0/metrics.csv").read_text().splitlines()]
    header = logged[0]
    rows = [dict(zip(header, row, strict=True)) for row in logged[1:]]
    assert [int(row["step"]) for row in rows if row.get("probe")] == steps == [2, 5]
