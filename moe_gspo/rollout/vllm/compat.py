"""What an in-process vLLM engine changes in the trainer's process, and how the engine keeps the process as it was.

    with in_process_engine_env(on_cuda=False):   # around building vLLM's LLM in this process
        llm = LLM(...)
    release = release_llm(llm)                    # vLLM's shutdown, minus tearing down the trainer's process group
    untruncated_logprobs(model_runner)            # log-probs before top-p truncation (RolloutBatch's convention)

The engine core runs in the trainer's process (VLLM_ENABLE_V1_MULTIPROCESSING=0). Both share torch's one OpenMP
runtime; vLLM's CPU worker would pin OpenMP threads to cores and then forbid `torch.set_num_threads` process-wide,
so the engine is built with thread binding off (VLLM_CPU_OMP_THREADS_BIND=nobind unless set), and the thread count,
`torch.set_num_threads`, the RNG states and the frozen GC heap it leaves behind while starting are restored. vLLM's
start-up garbage collections are skipped on the CPU (see in_process_engine_env). vLLM's in-process client would
also, when collected, tear down torch.distributed's default process group (the trainer's): release_llm replaces that
shutdown with one that releases only the engine's own resources.
"""

from __future__ import annotations

import gc
import os
import random
import weakref
from contextlib import contextmanager

import numpy as np
import torch

from moe_gspo.rollout.vllm.families import import_vllm_quietly

CPU_KV_CACHE_GIB = 1
"""KV cache of a CPU engine (VLLM_CPU_KVCACHE_SPACE, GiB) unless the environment sets one; vLLM's own default is
half the machine's memory."""


def no_collection(generation: int = 2) -> int:
    """gc.collect while a CPU engine starts (see in_process_engine_env): collects nothing."""
    return 0


@contextmanager
def in_process_engine_env(on_cuda: bool):
    """Environment and process state for building an in-process engine: vLLM's defaults set where the user set
    none, and what vLLM changes process-wide while starting (torch's thread count and set_num_threads, the Python,
    NumPy and torch RNG states, a frozen GC heap) restored afterwards. On the CPU, vLLM's start-up collections are
    skipped: it runs five full `gc.collect()`s (around its weight load, and to freeze the heap) to release transient
    accelerator memory before measuring it, and inside a trainer's process each walks the trainer's whole heap, 1.3 s
    of a 2.1 s build of the tiny engine; on the CPU nothing is measured, and the heap is unfrozen below anyway."""
    defaults = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    if not on_cuda:
        defaults |= {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_CPU_KVCACHE_SPACE": str(CPU_KV_CACHE_GIB)}
    for k, v in defaults.items():
        os.environ.setdefault(k, v)
    import_vllm_quietly()
    threads, set_threads = torch.get_num_threads(), torch.set_num_threads
    states = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    cuda_states = torch.cuda.get_rng_state_all() if on_cuda else None
    frozen = gc.get_freeze_count()
    collect = gc.collect
    if not on_cuda:
        gc.collect = no_collection
    try:
        yield
    finally:
        gc.collect = collect
        if not frozen:  # vLLM freezes the GC heap after start-up, which would keep the trainer's garbage forever
            gc.unfreeze()
        torch.set_num_threads = set_threads
        torch.set_num_threads(threads)
        random.setstate(states[0]), np.random.set_state(states[1]), torch.random.set_rng_state(states[2])
        if cuda_states is not None:
            torch.cuda.set_rng_state_all(cuda_states)




def untruncated_logprobs(model_runner) -> bool:
    """Make the model runner's TopKTopPSampler return, as its processed log-probs, log softmax of the logits it is
    given (temperature applied, top-k/top-p not yet) instead of the nucleus-renormalized ones; sampling is
    unchanged. False where the runner has no such sampler."""
    sampler = getattr(getattr(model_runner, "sampler", None), "topk_topp_sampler", None)
    if sampler is None or getattr(sampler, "_moe_gspo_untruncated", False):
        return sampler is not None
    inner = sampler.forward

    def forward(logits, generators, k, p):
        if k is None and p is None:  # nothing masked: vLLM's processed log-probs are already the full ones
            return inner(logits, generators, k, p)
        full = logits.log_softmax(dim=-1, dtype=torch.float32)  # before top-k/top-p mask the logits (in place)
        sampled, processed = inner(logits, generators, k, p)
        return sampled, None if processed is None else full

    sampler.forward = forward
    sampler._moe_gspo_untruncated = True
    return True


def release_llm(llm) -> weakref.finalize:
    """Take over the shutdown of an in-process vLLM `LLM`: vLLM's own (run when its client is collected, or at exit)
    ends in `cleanup_dist_env_and_memory`, which destroys torch.distributed's default group, the trainer's, and
    vLLM's model-parallel groups, which the next engine in this process reuses. Returns a finalizer (call it to shut
    down now; it also runs when the LLM is collected) that releases the engine core's executor, scheduler and
    structured-output backend only."""
    client = llm.llm_engine.engine_core
    client._finalizer.detach()
    return weakref.finalize(llm, _release_core, client.engine_core)


def _release_core(core) -> None:
    for part, method in ((core.structured_output_manager, "clear_backend"), (core.model_executor, "shutdown"),
                         (core.scheduler, "shutdown")):
        if part is not None:
            getattr(part, method)()
