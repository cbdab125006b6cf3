"""``posttrain quickstart``: the whole pipeline on an embedded tiny model and task, on CPU."""
