"""train.py under torchrun, with rank 1 raising at its second training step (for tests/test_fsdp.py)."""

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
import train  # noqa: E402
import trainers  # noqa: E402

original_step = trainers.BasicTrainer.train_step


def failing_step(self, batch):
    if self.rank == 1 and self.state.batch_counter == 1:
        raise RuntimeError("injected failure on rank 1")
    return original_step(self, batch)


trainers.BasicTrainer.train_step = failing_step
os.environ.setdefault("WANDB_MODE", "disabled")
sys.exit(train.main(sys.argv[1:]))
