"""What is read out of the store for people: reports, plots, tables, the plugin diagnosis (doctor)."""
