"""Model-card templates, one per ``model_type`` (``<model_type>.md``): read by :mod:`selective_rope.modeling.model_card`
through ``importlib.resources``, so they are found in a checkout, an editable install and an installed wheel alike."""
