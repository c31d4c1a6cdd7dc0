"""Multi-host serving: `init_distributed` joins this process to a `jax.distributed` job.

JAX is multi-controller: every process runs the same program. After `init_distributed`,
`jax.devices()` lists every process's devices, and `LLM(tensor_parallel_size=k)` builds its mesh
over the first k of them, across processes; each process holds only its own shards. Every
process must then make the same calls with the same arguments (the same prompts, adapters and
seeds, in the same order): the engine's scheduling is deterministic, so the processes take the
same steps, and each one gets every output (they are replicated). The OpenAI server is
single-process (one front end would have to forward each request to the others).
"""

from __future__ import annotations

from typing import Any


def init_distributed(coordinator_address: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None, **kwargs: Any) -> None:
    """`jax.distributed.initialize(...)` with the same arguments, before anything touches a device.

    On CPU it first selects the gloo collectives (XLA:CPU has no cross-process collectives
    without them). Arguments left None are found by JAX where it can (TPU pods, SLURM, ...).
    """
    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")  # the CPU backend's only; others ignore it
    jax.distributed.initialize(coordinator_address, num_processes=num_processes, process_id=process_id, **kwargs)
