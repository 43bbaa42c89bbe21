"""Cost models: hardware and cluster specs, calibration, pure compute/communication/memory models,
the closed forms of the papers, and a simulator of plans (see DESIGN.md, "Cost models")."""
