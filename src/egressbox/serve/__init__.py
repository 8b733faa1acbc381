"""The `egressbox serve` process: options, workers, fleet, admin, watch, systemd."""
