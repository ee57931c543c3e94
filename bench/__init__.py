"""Measured speed and calibration: the code behind `pagelab bench core|simulate|attention|engine|calibration`
and `python -m bench.profile|calibration|paper`, plus `bench.run_tools`, the run-folder functions the
`pagelab` commands share with these tools. Nothing here imports `cli`: the CLI calls into bench, not back.
"""
