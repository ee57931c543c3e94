"""How long a step takes: the step-latency models (roofline and fitted), measured step times that replace
them, the fit of a model to measured replays (calibration), and simulated-versus-measured comparison."""
