"""What the benchmarks share: load generation (load), py-spy profiling (profile), report formatting
(report), the service's request steps timed in-process (breakdown). Each benchmark is a script
over these (`python -m bench.NAME`)."""
