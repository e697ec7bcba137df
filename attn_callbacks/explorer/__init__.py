"""The attention explorer: TensorBoard's "Attention" tab, to search any tracked token and watch its attention move
across epochs. :mod:`.data` is the on-disk format (the monitor writes it through :mod:`attn_callbacks.output.report`,
the plugin reads it), :mod:`.queries` what the tab asks of it, :mod:`.plugin` the TensorBoard plugin and
``static/index.js`` the tab itself. Imports the standard library, numpy, werkzeug and tensorboard only, never torch
or another part of the package but :mod:`attn_callbacks.base.files` and :mod:`attn_callbacks.base.config` (numpy
only): TensorBoard imports the plugin at start."""
