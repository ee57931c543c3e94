"""Measured speed: the code behind `pagelab bench core|simulate|attention|engine` (not library code)."""
