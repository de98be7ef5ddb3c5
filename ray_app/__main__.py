"""``python -m ray_app`` is the same as ``ray-app``."""

from ray_app.driver.cli import run

run()
