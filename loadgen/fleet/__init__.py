"""Fleet-scale discrete-event simulation of fairbatch (issue 7): N simulated replicas, R routers."""
