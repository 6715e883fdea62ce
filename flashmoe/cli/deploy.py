"""`flashmoe deploy up|status|down`: the compose file's services through the Docker SDK."""

from __future__ import annotations

import sys


def cmd_deploy(args) -> int:
    from flashmoe import deploy

    common = dict(compose_files=args.compose or [deploy.DEFAULT_COMPOSE_FILE],
                  project=args.project, profiles=args.compose_profile,
                  docker_host=args.docker_host)
    try:
        if args.deploy_command == "up":
            rows = deploy.deploy_up(**common, services=args.services, build=args.build,
                                    wait=args.wait, timeout_s=args.timeout)
        elif args.deploy_command == "status":
            rows = deploy.deploy_status(**common)
        else:
            for line in deploy.deploy_down(**common, volumes=args.volumes):
                print(line)
            return 0
    except deploy.DeployError as exc:
        print(f"flashmoe deploy {args.deploy_command}: error: {exc}", file=sys.stderr)
        return 2
    print(deploy.format_status(rows))
    return 0 if all(row.ok for row in rows) or args.deploy_command == "up" else 1


def register(sub) -> None:
    p = sub.add_parser("deploy", help="the compose file's services through the Docker SDK")
    deploy_sub = p.add_subparsers(dest="deploy_command", required=True)
    for name, text in (("up", "create and start"),
                       ("status", "state and health of each service"),
                       ("down", "stop and remove")):
        q = deploy_sub.add_parser(name, help=text)
        q.add_argument("--compose", action="append", metavar="FILE",
                       help="compose file(s) (default compose.yaml; repeat for overrides)")
        q.add_argument("--project", help="project name (default: the folder's)")
        q.add_argument("--docker-host", help="e.g. unix:///var/run/docker.sock")
        q.add_argument("--profile", dest="compose_profile", action="append", default=[],
                       help="compose profile(s) to enable, e.g. cluster")
        if name == "up":
            q.add_argument("services", nargs="*", metavar="SERVICE",
                           help="only these services and their dependencies (default: all "
                                "that the profiles enable)")
            q.add_argument("--build", action="store_true", help="build the image first")
            q.add_argument("--wait", action="store_true", help="until every service is healthy")
            q.add_argument("--timeout", type=float, default=300.0)
        if name == "down":
            q.add_argument("--volumes", action="store_true", help="remove the volumes too")
        q.set_defaults(func=cmd_deploy)
