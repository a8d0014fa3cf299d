"""Distributed training from one controller: one :class:`Plan`, torch's own parallelisms.

Choose data parallel (``dp``), fully sharded (``fsdp``), tensor (``tp``) and
pipeline (``pp``) parallelism, and their products, with one argument; the
trainer applies them with torch's implementations (DDP, FSDP2 ``fully_shard``,
DTensor ``parallelize_module``, ``torch.distributed.pipelining``) in
torchtitan's order. ``auto_plan``/``partition`` choose a plan and pipeline
stage boundaries from measured layer costs. See docs/parallel.md.

Example::

    from functools import partial
    import torch
    from actormesh.actor import this_host
    from actormesh.parallel import Plan, spawn_trainer
    from actormesh.parallel.models import GPTConfig, gpt, lm_loss, synthetic_batches

    procs = this_host().spawn_procs(per_host={"gpus": 4})
    trainer = spawn_trainer(procs, partial(gpt, n_blocks=4), lm_loss,
                            partial(torch.optim.SGD, lr=0.1), Plan(dp=2, tp=2))
    for _, batch in zip(range(3), synthetic_batches(GPTConfig(), batch_size=8)):
        print(trainer.step.call(batch).get(timeout=120).values()[0])
    trainer.save.call("/tmp/ckpt").get(timeout=120)   # resumable under another Plan

Importing this package does not import torch (``actormesh.parallel.models`` does).
"""

from ._apply import parallelize_chunk, world_mesh
from ._auto import AutoPlan, auto_plan
from ._generate import StageLinks, StepPlan, StepRunner
from ._sampling import Sampler, Shaping, sample_token
from ._kv_cache import KVCache
from ._partition import LayerCost, partition
from ._pipeline import check_stages, equal_stages
from ._plan import MESH_DIMS, Plan, PlanError
from ._replica import build_chunk, check_inference_plan, check_weights, hidden_size_of, load_weights, read_weights, replica_stages, stage_links
from ._tp import COLWISE_NAMES, ROWWISE_NAMES, default_tp_plan
from ._train_checkpoint import CheckpointMismatch
from ._train_data import TrainDataError
from ._train_elastic import ElasticTrainer, Recovery, TrainingFailed, spawn_elastic_trainer
from ._train_figures import StepFigures
from ._train_options import LRSchedule, TrainOptions, TrainOptionsError
from ._publish import PublishedWeights, resolve_weights
from ._staging import StagedWeights, WeightStaging
from ._trainer import Trainer, gather_state_dict, publish_weights, spawn_trainer

__all__ = [
    "AutoPlan",
    "CheckpointMismatch",
    "ElasticTrainer",
    "Recovery",
    "KVCache",
    "LRSchedule",
    "StepFigures",
    "TrainOptions",
    "TrainOptionsError",
    "TrainDataError",
    "TrainingFailed",
    "spawn_elastic_trainer",
    "Sampler",
    "StageLinks",
    "StepPlan",
    "Shaping",
    "StepRunner",
    "sample_token",
    "build_chunk",
    "check_inference_plan",
    "check_weights",
    "hidden_size_of",
    "load_weights",
    "read_weights",
    "replica_stages",
    "stage_links",
    "parallelize_chunk",
    "world_mesh",
    "COLWISE_NAMES",
    "LayerCost",
    "MESH_DIMS",
    "Plan",
    "PlanError",
    "ROWWISE_NAMES",
    "Trainer",
    "check_stages",
    "auto_plan",
    "default_tp_plan",
    "equal_stages",
    "gather_state_dict",
    "publish_weights",
    "PublishedWeights",
    "resolve_weights",
    "StagedWeights",
    "WeightStaging",
    "partition",
    "spawn_trainer",
]
