"""The 'vllm' rollout engine and everything it needs of vLLM; nothing here imports vLLM until an engine is built
or asked about (families.vllm_installed reads the package metadata).

    engine.py      VLLMEngine: vLLM's offline LLM in the trainer's process, token ids in and out, registered as 'vllm'
    compat.py      what vLLM changes in the trainer's process while starting, and how it is put back
    families.py    the families vLLM serves, and what its model of each fixes whatever config.json says
    mla.py         latent attention (DeepSeek-V3): the absorbed matrices after a load, the CPU rotary patch
    taps.py        routed experts captured on the CPU (R3), mapped to requests
    shm.py         a tensor-parallel CPU engine's shared memory
    sync.py        an engine rank's weight sync: whole tensors (one rank) or its slices, chosen once
    writer.py      vLLM's parameter layout per engine rank, and the writer that puts slices in place
    cpu_writer.py  the CPU writer of whole tensors and prepacked experts
"""
