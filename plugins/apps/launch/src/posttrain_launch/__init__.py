"""Launchers: start a Ray cluster on a batch system, then a ``posttrain run`` on its head.

Ray is the scheduler; these only write what starts Ray on the nodes a batch system gives:
an sbatch script for Slurm (:mod:`posttrain_launch.slurm`), a KubeRay ``RayJob`` manifest
for Kubernetes (:mod:`posttrain_launch.kuberay`), and the wait for a cluster's nodes that the
script runs before the run (:mod:`posttrain_launch.wait`). ``posttrain launch`` is their
command line (:mod:`posttrain_launch.command`).
"""
