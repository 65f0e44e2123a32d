"""The MLA problem: model dimensions and workloads, random instances, the torch reference, the roofline."""
