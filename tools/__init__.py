"""Tools around the nodes: the CLI, the headless runner, UI→API conversion, the benches and the model generator."""
