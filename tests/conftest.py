"""Every test runs offline: no model hub, no dataset hub, no W&B server."""

import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# Runs and the tokenized-data cache go to one temporary directory per test session, never into the repo's
# .cache: every train.py argument list in the tests adds LOCAL_DIRS (a test with its own local_dirs overrides it).
import atexit  # noqa: E402
import shutil  # noqa: E402
import tempfile  # noqa: E402

TEST_LOCAL_DIR = tempfile.mkdtemp(prefix="dpo-tests-")
atexit.register(shutil.rmtree, TEST_LOCAL_DIR, ignore_errors=True)
LOCAL_DIRS = f"local_dirs=[{TEST_LOCAL_DIR}]"


def pytest_configure(config):
    config.addinivalue_line("markers", "gpu: needs CUDA (tests/gpu/); skipped without it")
