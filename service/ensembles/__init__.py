"""Triton's ensembles: a model whose versions run a DAG of other models' steps in the service,
each step a request of the data plane (service/ensembles/steps.py), built as a version of platform
`ensemble` loads (service/ensembles/loader.py)."""
