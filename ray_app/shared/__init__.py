"""The shared room: what every process imports (config, errors and the failure table, storage and its
retries, the checkpoint catalog, the lease, the journal, plug-ins, tasks, data, models, the Ray seam).
It imports nothing of the driver's, the controller's or the workers' rooms."""
