"""Run folders -> tables and plots: comparing objectives with honest statistics.

Modules
-------
runs
    Read run folders (summary, config, metric curves) and find them in sweeps.
groups
    Group runs by task and objective; check that a group differs only in seeds.
budgets
    What a matched budget means, and the check that refuses mixed budgets.
statistics
    IQM, stratified bootstrap intervals, probability of improvement, threshold crossing.
plots
    Learning curves against frames and wall time; reward against KL.
report
    The whole comparison: Markdown and CSV tables, and the plots.
run_curves
    The learning curves of one run, or of a few side by side (``python -m nip_like.analyse plot``).
run_page
    A run's HTML page: its curves, final metrics, config and latest transcripts.
message_regression
    Does the transcript carry the answer? Regressors on the provers' messages.
"""
