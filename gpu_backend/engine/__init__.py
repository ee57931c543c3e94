"""The engine: requests in, tokens out, over the shared Scheduler and allocator and a paged KV cache."""
from gpu_backend.engine.llm_engine import LLMEngine, StepResult

__all__ = ["LLMEngine", "StepResult"]
