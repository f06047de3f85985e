"""Models out: when a job runs, the job itself, the promotion gate and its evidence, the base model, the
child processes that a stop ends at once (ONNX export, stage profile), and the device's side of a fleet."""
