"""Cost models: device and link specs and presets (``specs``), clusters and saved profiles
(``hardware``), pure compute/communication/memory models, the closed forms of the papers, and a
simulator of plans (see DESIGN.md, "Cost models"). Measuring a host is above the runtime:
:func:`gnncompile.calibrate`."""
