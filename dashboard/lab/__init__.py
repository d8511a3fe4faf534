"""The lab's fitting and reference code, run by the operator (``manage.py bench lab*``, the lab extra):
the reference engine, predictor fitting, anchor fine-tuning and their calibration text. Boards serve
what it fits (``inference.lab``) and never import it."""
