"""The demo model of assets/demo: its corpus, its batched training forward and its trainer
(`PYTHONPATH=tests python -m tools.demo.train_demo`; assets/README.md)."""
