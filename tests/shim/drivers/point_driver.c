/*
 * point_driver: the shim's choice of a front point (shim/src/exec.c: mu_plan_point, then
 * mu_plan_lean_point under MUCUDNN_WORKSPACE_SLACK from the environment) on its own, for
 * tests/shim/test_shim_lean_point.py. Each input line is one kernel's front:
 *
 *   LIMIT WORKSPACE:MS WORKSPACE:MS ...      points by workspace ascending
 *
 * and the output one line each: the 0-based index of the point taken, or "none".
 * Built from every shim source (its functions are hidden in libmucudnn.so).
 */
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

enum { MAX_POINTS = 64 };

int main(void) {
    mu_options_init();
    char line[4096];
    while (fgets(line, sizeof line, stdin) != NULL) {
        mu_plan_entry points[MAX_POINTS];
        memset(points, 0, sizeof points);
        char *rest = line, *end;
        unsigned long long limit = strtoull(rest, &end, 10);
        if (end == rest) return 2;
        int count = 0;
        for (rest = end; count < MAX_POINTS; rest = end) {
            unsigned long long workspace = strtoull(rest, &end, 10);
            if (end == rest || *end != ':') break;
            points[count].workspace = (size_t)workspace;
            points[count].time_ms = strtod(end + 1, &end);
            atomic_init(&points[count].disabled, false);
            if (count > 0) points[count - 1].next_point = &points[count];
            count++;
        }
        if (count == 0) return 2;
        mu_plan_entry *fastest = mu_plan_point(points, (size_t)limit, false);
        mu_plan_entry *taken = mu_plan_lean_point(points, fastest, false);
        if (taken == NULL) printf("none\n");
        else printf("%d\n", (int)(taken - points));
    }
    return 0;
}
