"""A finished or running run's files read back (`workdir`), turned into arrays (`arrays`) and
drawn (`plots`): the toolkit the run report (`dynjax.report`) and the schemes' own report
plots (`dynjax.dynamism.base.Plugin.report_plots`) are built from, below both."""
