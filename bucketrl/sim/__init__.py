"""SIMULATION for benchmarks and tests: a GPU model, a simulated trainer and a fleet of simulated generators.

Nothing here trains anything. Every part except the GPU is real (proxy, Redis, S3 over HTTP, the trainer
worker, the wire protocol); ``bench/scale_sim.py`` runs it at hundreds of generators.
"""
