"""A torchtitan config module that checkpoints through cryosnap: torchtitan's Llama 3 debug
model with ``CryosnapCheckpointManager`` in place of its DCP manager.

Run it with torchtitan's launcher (its full install and a checkout of its repository at the
release, for the debug model's tokenizer and the ``c4_test`` data under ``tests/assets``):

    cd torchtitan && PYTHONPATH=/path/to/cryosnap/examples:/path/to/cryosnap/src \\
      torchrun --nproc_per_node=1 -m torchtitan.train \\
      --module torchtitan_cryosnap --config cryosnap_debugmodel

``CRYOSNAP_SCRATCH`` names a node-local directory written first (flushed in the background
to the run's folder). bench/gpu_torchtitan.sh runs it on one GPU, kills it and resumes it.
"""

from __future__ import annotations

import os

from torchtitan.models.llama3.config_registry import llama3_debugmodel
from torchtitan.trainer import Trainer

from cryosnap.integrations.torchtitan import CryosnapCheckpointManager


def cryosnap_debugmodel() -> Trainer.Config:
    """torchtitan's ``llama3_debugmodel``, saved every 5 steps into ``dump_folder/cryosnap``."""
    config = llama3_debugmodel()
    config.training.steps = int(os.environ.get("CRYOSNAP_STEPS", "20"))
    # A resumed run is compared with an uninterrupted one, loss for loss.
    config.debug.seed = 0
    config.debug.deterministic = True
    config.checkpoint = CryosnapCheckpointManager.Config(
        enable=True,
        folder="cryosnap",
        interval=5,
        keep_latest_k=3,
        last_save_model_only=False,  # the last version resumes too
        scratch=os.environ.get("CRYOSNAP_SCRATCH") or None,
    )
    return config
