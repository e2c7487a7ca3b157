"""The demo and test models: `models.demo_models` builds them; `models/demo` is the bundled
repository. Development tooling, not part of any installed process: the service never imports it."""
