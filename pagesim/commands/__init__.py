"""One module per `pagesim` command (or family of commands): its arguments, the study configuration
they make, and what it prints while the study runs; the study itself lives in analysis/, and its
report is written by pagesim.report_writer."""
