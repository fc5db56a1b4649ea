"""The setup layer every process of a run builds from (tether.setup): the driver, the
rollout workers, the data-parallel trainer ranks and the probe place the model the same way."""

from __future__ import annotations

import pytest

from tether.config import load_config
from tether.distributed import start_ranks
from tether.errors import InputError
from tether.setup import load_policy, sampling_params
from tether.trainer import Trainer


def test_each_trainer_rank_places_its_model_with_run_device(warm_model_dir):
    cfg = load_config("configs/countdown.yaml",
                      [f"model.path={warm_model_dir}", "train.world_size=2", "run.device=cpu",
                       "rollout.prompts_per_step=4", "rollout.group_size=4", "run.threads=1"])
    _, model, _ = load_policy(cfg)
    trainer = Trainer(model, cfg.train, sampling_params(cfg, model.config.vocab_size))
    ranks = start_ranks(trainer, cfg, warm_model_dir)
    try:
        assert trainer.collective is ranks  # rank 0 trains through the ranks it was handed
        assert ranks.devices == ["cpu", "cpu"]  # as each rank reports its own parameters
    finally:
        ranks.stop()


def test_a_gpu_torch_cannot_see_fails_where_every_process_places_its_model(warm_model_dir):
    # load_policy is the one placement: the driver, a rollout worker and a trainer rank all
    # call it, so none of them can keep its model on the CPU while run.device says otherwise.
    cfg = load_config("configs/countdown.yaml", [f"model.path={warm_model_dir}",
                                                 "run.device=cuda:7"])
    with pytest.raises(InputError, match="run.device=cuda:7: torch sees 0 CUDA"):
        load_policy(cfg, warm_model_dir)
