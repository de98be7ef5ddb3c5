"""The controller's room: what runs in Ray Train's controller actor, one per run, between the driver and
the workers (the failure and scaling policies, the process group's backend, the hang reports' verdict).
It never imports from the driver's room."""
