"""pagelab gpu_backend: a Llama-family model served over a paged KV cache by the simulator's own scheduler.

`from gpu_backend import LLMEngine, SamplingParams` is the vLLM-like entry point; importing this package
does not import Triton (only the Triton attention backend does).
"""
from gpu_backend.engine.llm_engine import LLMEngine, StepResult
from gpu_backend.engine.params import CompletionOutput, EngineInputError, RequestOutput, SamplingParams

__all__ = ["CompletionOutput", "EngineInputError", "LLMEngine", "RequestOutput", "SamplingParams",
           "StepResult"]
