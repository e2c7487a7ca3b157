"""What the benchmarks share: load generation (load), py-spy profiling (profile), report formatting
(report), the service's request steps timed in-process (breakdown), /proc readings (procfs), the
`--trees LABEL=PATH,...` parser and the PYTHONPATH that runs a tree's code (trees). Each benchmark
is a script over these (`python -m bench.NAME`); child processes are bench.processes' and
bench.stack's (over modelyard.process.children)."""
