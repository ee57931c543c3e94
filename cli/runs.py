"""Writing run folders: the implementation lives in `pagelab.run_folder` so library code can share it."""
from pagelab.run_folder import write_json, write_run, write_table

__all__ = ["write_json", "write_run", "write_table"]
