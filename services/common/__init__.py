"""What every infermesh service shares: errors, tensors, config, metrics, serving helpers."""
