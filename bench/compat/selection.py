"""Which of Monarch 0.7.0's test files and docs examples the harness runs, and why not the rest.

The rule (issue 11): a file is used when it exercises Monarch's public API
(``monarch.actor``, ``monarch.rdma``, ``monarch.job``, ``monarch.config``,
``monarch.spmd``) and needs neither CUDA nor Monarch's private internals
(``monarch._src``, ``monarch._rust_bindings``) at import time. A file whose private
imports sit inside a few test functions is used; those tests fail on actormesh and
GAPS.md counts them apart ("private internals"). Files are named relative to the
wheel's ``tests/`` directory; examples relative to the examples directory.
"""

from __future__ import annotations

# Test files run on both implementations.
TEST_FILES: tuple[str, ...] = (
    "test_cookbook.py",  # docs cookbook recipes: Actor, endpoint, Port, Channel, this_host
    "test_gil_stranding.py",  # endpoints, MeshFailure, supervision under a held GIL
    "test_receive_ownership_characterization.py",  # Channel / Port / PortReceiver ownership
    "test_worker_fork_contract.py",  # this_host / this_proc, fork from an actor
    "test_port_forward.py",  # monarch.job.PortForwarder
    "test_shell.py",  # monarch.job.shell
    "test_rdma_unit.py",  # RDMABuffer read/write/drop
    "test_rdma_action.py",  # RDMAAction
    "test_rdma_characterize.py",  # RDMABuffer + config.configured
    "test_rdma_cpu_no_torch.py",  # RDMABuffer over bytes/memoryview without torch
    "test_rdma.py",  # RDMABuffer; 4 tests import monarch._src.rdma inside the test
)

# Monarch docs examples (docs/source/examples/*.py) run as scripts: pass = exit 0.
EXAMPLE_FILES: tuple[str, ...] = (
    "ping_pong.py",  # Actor, endpoint, current_rank, slice, call/call_one
    "grpo_actor.py",  # actors + RDMABuffer + torch (CPU)
    "grpo_yield.py",  # actors, Channel, Port, send
)

# Every other file of the wheel's tests/ (top level) with the reason it is not used.
_PRIVATE = "imports Monarch private internals at module level: "
EXCLUDED_TEST_FILES: dict[str, str] = {
    "test_accumulator_characterization.py": _PRIVATE + "monarch._src.actor.future, monarch._rust_bindings...pytokio",
    "test_actor_driver_characterization.py": _PRIVATE + "monarch._src.actor.host_mesh, monarch._rust_bindings...pytokio",
    "test_actor_error.py": _PRIVATE + "monarch._rust_bindings (panic, actor_mesh, mailbox, supervision), monarch._src.actor.*",
    "test_actor_logging.py": _PRIVATE + "monarch._src.actor.host_mesh.this_host (the same object as the public monarch.actor.this_host; otherwise public)",
    "test_actor_loop_finalization.py": "imports monarch.python.tests (a Buck-synthesised package of Meta's internal build) and runs a Rust test binary",
    "test_actor_shape.py": _PRIVATE + "monarch._src.actor.shape, monarch._rust_bindings...shape",
    "test_admin_spawn_characterization.py": _PRIVATE + "monarch._src.actor.*, monarch._rust_bindings...host_mesh (mesh admin)",
    "test_builtins_log.py": "tensor engine (monarch._testing, monarch.builtins); not the actor API",
    "test_builtins_random.py": "tensor engine + CUDA",
    "test_chain_broadcast.py": _PRIVATE + "monarch._rust_bindings.monarch_extension.chain_broadcast",
    "test_cli_integration.py": "monarch CLI and gather_mount internals (monarch._src.job, monarch._src.gather_mount)",
    "test_client_context_guard.py": _PRIVATE + "monarch._rust_bindings.monarch_hyperactor.*, monarch._src.actor.*",
    "test_client_shutdown.py": _PRIVATE + "monarch._rust_bindings.monarch_hyperactor, monarch._src.actor.future",
    "test_coalescing.py": "tensor engine (monarch.common, monarch._testing)",
    "test_concurrent_endpoints.py": _PRIVATE + "monarch._rust_bindings...actor/pympsc/supervision, monarch._src.actor",
    "test_config.py": _PRIVATE + "monarch._rust_bindings...channel/config/supervision (the Rust config store)",
    "test_controller.py": "tensor engine + CUDA",
    "test_controller_dedup.py": _PRIVATE + "monarch._src.actor.proc_mesh.get_or_spawn_controller",
    "test_cuda.py": "needs CUDA",
    "test_debugger.py": _PRIVATE + "monarch._src.actor.debugger.* (debugger internals)",
    "test_deferred_pickle_characterization.py": _PRIVATE + "monarch._rust_bindings...pickle, monarch._src.actor.*",
    "test_device_mesh.py": "tensor engine (monarch.common.device_mesh, monarch.simulator)",
    "test_distributed_telemetry.py": _PRIVATE + "monarch._src.job.telemetry_actor, monarch.distributed_telemetry.engine (SQL telemetry)",
    "test_extension_linking.py": _PRIVATE + "monarch._rust_bindings (native extension linkage)",
    "test_failure_introspection.py": _PRIVATE + "monarch._src.actor.host_mesh._spawn_admin (mesh admin)",
    "test_future.py": "tensor engine (monarch.common.future), monarch._rust_bindings",
    "test_future_characterization.py": _PRIVATE + "monarch._src.actor.future, monarch._rust_bindings...pytokio/testing",
    "test_gather_mount.py": "monarch.gather_mount (FUSE mount), monarch._src.gather_mount",
    "test_gil_on_control_plane.py": _PRIVATE + "monarch._rust_bindings...runtime; also CUDA",
    "test_grad_generator.py": "tensor engine (monarch.gradient)",
    "test_host_mesh.py": _PRIVATE + "monarch._rust_bindings...host_mesh/proc/shape, monarch._src.actor.*, monarch._src.job.*",
    "test_inter_mesh_ping_pong.py": _PRIVATE + "monarch._src.actor.host_mesh.this_host (the same object as the public monarch.actor.this_host; otherwise public)",
    "test_job.py": _PRIVATE + "monarch._src.job.* (job sidecar, mast, once_daemon), monarch._rust_bindings",
    "test_logging_initialization_characterization.py": _PRIVATE + "monarch._src.actor.logging, monarch._rust_bindings",
    "test_mesh_trait.py": _PRIVATE + "monarch._src.actor.shape",
    "test_mock_cuda.py": "tensor engine CUDA mock (monarch.common.mock_cuda)",
    "test_port_reconstruction.py": _PRIVATE + "monarch._rust_bindings...mailbox/pickle/proc, monarch._src.actor.*",
    "test_proc_mesh.py": _PRIVATE + "monarch._rust_bindings...proc_mesh/shape, monarch._src.actor.*",
    "test_python_actors.py": _PRIVATE + "monarch._rust_bindings...actor/buffers/mailbox/proc/pytokio, monarch._src.actor.*, monarch._src.job.*",
    "test_rdma_bench_driver.py": "Monarch's multihost RDMA benchmark driver (benches/multihost_rdma), monarch._rust_bindings...shape",
    "test_rdma_bench_e2e.py": "Monarch's RDMA benchmark end to end (benches/), no monarch API import",
    "test_rdma_bench_peer.py": "Monarch's multihost RDMA benchmark peer (benches/multihost_rdma bench_peer, bench_topology)",
    "test_rdma_bench_stats.py": "RDMA benchmark statistics; imports no monarch module",
    "test_rdma_bench_topology.py": "RDMA benchmark topology; imports no monarch module",
    "test_rdma_local_memory_cache.py": _PRIVATE + "monarch._src.rdma (memory cache internals)",
    "test_rdma_readiness_and_operations.py": _PRIVATE + "monarch._rust_bindings.rdma, monarch._src.rdma",
    "test_remote_functions.py": "tensor engine + CUDA",
    "test_remotemount.py": "monarch.remotemount (FUSE), monarch._rust_bindings.monarch_extension",
    "test_returns_future.py": _PRIVATE + "monarch._src.actor.returns_future, monarch._src.actor.sync_state",
    "test_rust_bindings_load.py": "loads monarch._rust_bindings",
    "test_rust_struct_mixins.py": _PRIVATE + "monarch._rust_bindings...testing, monarch._src.actor.python_extension_methods",
    "test_rust_struct_value_mesh.py": _PRIVATE + "monarch._rust_bindings...value_mesh, monarch._src.actor.mpsc",
    "test_shutdown_without_client.py": _PRIVATE + "monarch._src.actor.actor_mesh",
    "test_signal_safe_block_on.py": "runs a Rust test binary from monarch.python.tests (Meta's internal build)",
    "test_spmd.py": _PRIVATE + "monarch._src.job.spmd (_parse_torchrun, SPMDJob, StoreJob), patches monarch._src.job.*",
    "test_spmd_host_mesh.py": _PRIVATE + "monarch._src.spmd.host_mesh, monarch._rust_bindings...proc",
    "test_supervision_hierarchy.py": _PRIVATE + "monarch._rust_bindings.monarch_hyperactor.supervision.MeshFailure (public as monarch.actor.MeshFailure; otherwise public)",
    "test_sync_actor_driver.py": _PRIVATE + "monarch._rust_bindings...handle/pickle/supervision/testing, monarch._src.actor.*",
    "test_telemetry_attributes.py": _PRIVATE + "monarch._src.actor.telemetry",
    "test_telemetry_config.py": _PRIVATE + "monarch._src.job.* (telemetry sidecar)",
    "test_telemetry_query_client.py": _PRIVATE + "monarch._src.job._telemetry_query_client",
    "test_tensor_engine.py": "tensor engine (monarch.mesh_controller) + CUDA",
    "test_value_mesh_compression_scheme.py": "a pure-Python model of a compression scheme; imports no monarch module",
    "test_worker_loop_characterization.py": _PRIVATE + "monarch._rust_bindings.monarch_hyperactor.bootstrap",
}

EXCLUDED_TEST_DIRS: dict[str, str] = {
    "_monarch/": "tests of monarch._rust_bindings (hyperactor, mailbox, ndslice, ...)",
    "_src/": "tests of monarch._src.job (kubernetes, slurm) and monarch._src.tools",
    "code_sync/": "monarch code sync (monarch.code_sync), not part of the five public modules",
    "simulator/": "tensor-engine simulator (monarch.simulator)",
    "tools/": "monarch.tools (CLI, TorchX config), not part of the five public modules",
}

EXCLUDED_EXAMPLES: dict[str, str] = {
    "crawler.py": "needs the network (requests, bs4) to crawl a web site; this machine has none",
    "debugging.py": "interactive: stops at breakpoint() and waits for the monarch debugger",
    "getting_started.py": "uses the tensor engine (monarch.fetch_shard, monarch.remote)",
    "distributed_tensors.py": "uses the tensor engine (import monarch tensors, device meshes)",
    "spmd_ddp.py": "its train.py uses NCCL and .cuda() (needs 4 GPUs)",
    "ddp/*, grpo/*, otel_collector.py": "need Kubernetes (monarch._src.job.kubernetes) or torchx",
    "grpo_actor_te.py, grpo_te_sim.py, grpo_sim.py, grpo_forge_*.py": "tensor engine, monarch._src.actor.mock, or the forge package",
    "wheel examples/*.py": "telemetry/dashboard demos that run until Ctrl+C (ProcessJob.enable_telemetry)",
}

# Files used after a one-line import rewrite: each private import below names an
# object that Monarch 0.7.0 also exports publicly as the very same object (checked
# on Monarch: ``monarch._src.actor.host_mesh.this_host is monarch.actor.this_host``,
# ``monarch._rust_bindings...supervision.MeshFailure is monarch.actor.MeshFailure``,
# ``monarch._src.actor.proc_mesh.get_or_spawn_controller is monarch.actor.get_or_spawn_controller``).
# The rewritten copy runs on both implementations; nothing else in the file changes.
REWRITES: dict[str, tuple[tuple[str, str], ...]] = {
    "test_actor_logging.py": (("from monarch._src.actor.host_mesh import this_host", "from monarch.actor import this_host"),),
    "test_inter_mesh_ping_pong.py": (("from monarch._src.actor.host_mesh import this_host", "from monarch.actor import this_host"),),
    "test_supervision_hierarchy.py": (
        ("from monarch._rust_bindings.monarch_hyperactor.supervision import MeshFailure", "from monarch.actor import MeshFailure"),
    ),
    # monarch._src.actor.proc_mesh.get_or_spawn_controller is monarch.actor.get_or_spawn_controller
    "test_controller_dedup.py": (
        ("from monarch._src.actor.proc_mesh import get_or_spawn_controller", "from monarch.actor import get_or_spawn_controller"),
    ),
}
TEST_FILES = TEST_FILES + tuple(REWRITES)
for _name in REWRITES:
    EXCLUDED_TEST_FILES.pop(_name)
