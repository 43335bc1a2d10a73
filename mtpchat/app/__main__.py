"""`python -m mtpchat.app`: the app on the fake engine, for working on the UI without a model."""
import sys

from mtpchat.app.main import dev_args, run_app

sys.exit(run_app(dev_args()))
