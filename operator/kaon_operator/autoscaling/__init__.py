"""Autoscaling: the loop that scrapes the engines and routers (autoscale_loop, scraper), the pure
policies it asks (autoscaler: reactive; predictive, with perf_model, demand and model_bias), and
where the predictive policy's model comes from (profiling: pure; profile_sync: its I/O)."""
