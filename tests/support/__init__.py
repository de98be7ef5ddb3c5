"""What the test tiers share: free ports, the processes they start, tools they look up, the k8s renderer,
a tiny checkpoint, and the user code the script-mode and project tests write. Imported as ``tests.support.X``."""
