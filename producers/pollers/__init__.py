"""Pollers beside the job: NVML GPUs, vLLM engines and the trainer service's capacity, as records on the hardware topic."""
