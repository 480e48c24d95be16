"""The verification job: history DataFrame in, anomaly / summary DataFrames out (PySpark DataFrame API).

Everything is computed per run (``run`` is part of every key); nothing collects whole histories to
the driver. The definitions are written down in docs/verification.md; the comments here name the
rule each step implements.

Vocabulary used below:
- *subscriber*: one incarnation of an MQTT session: ``session#n`` where n counts the CONNACKs with
  session present = 0 seen so far (a clean start or an expired session makes a new subscriber).
- *connection*: the number of successful CONNECTs of the session so far (``conn``).
- *app delivery*: a received PUBLISH that reaches the application. A QoS 2 PUBLISH received again
  with the same packet id before that packet id was released (PUBCOMP sent) is the protocol's own
  resend and is not an app delivery.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from moorline.verify.topics import filter_to_regex

if TYPE_CHECKING:  # pragma: no cover
    from pyspark.sql import DataFrame, SparkSession

# Anomaly kinds that make verify fail, and those that are only reported.
FAILING_KINDS: tuple[str, ...] = (
    "lost",
    "duplicate",
    "unexpected",
    "out_of_order",
    "packet_id_misuse",
    "refused_delivered",
)
REPORTED_KINDS: tuple[str, ...] = ("lost_detected_corruption",)
ALL_KINDS: tuple[str, ...] = FAILING_KINDS + REPORTED_KINDS
# Drop reasons the broker counts; every one excuses the (message, session) it names.
DROP_REASONS: tuple[str, ...] = (
    "message_expiry",
    "queue_cap",
    "share_qos2_member_gone",
    "session_expired",
    "shard_cap",
    "subscribe_failed",
)
NO_GUID = "no_guid"  # publish invoke detail: sent without a guid user property
RETAINED = "retained"  # deliver detail: a PUBLISH received with RETAIN=1 (for a new subscription)
# mono_ns: when the anomaly shows in the history (the delivery; for a loss the acknowledgement; for a
# message not resent the connection it was owed on), for the report's timelines.
ANOMALY_COLUMNS: tuple[str, ...] = ("run", "kind", "guid", "subscriber", "topic", "detail", "mono_ns")
NS_PER_MS = 1_000_000


@dataclass
class Analysis:
    """The job's outputs (lazy DataFrames)."""

    anomalies: DataFrame  # ANOMALY_COLUMNS
    per_run: DataFrame  # one row per run: counts, latency percentiles, fault counts
    timeline: DataFrame  # run, second, acked, delivered, ack_p50_ms, ack_p99_ms
    faults: DataFrame  # run, t_s, reason, detail
    latency: DataFrame  # one row: percentiles over all runs (ms)


def _order(*cols: str) -> list[Any]:
    from pyspark.sql import functions as F

    return [F.col(c) for c in cols] + [F.col("mono_ns"), F.col("index")]


def _anoms(df: DataFrame, kind: str, detail: Any) -> DataFrame:
    """Project rows into the uniform anomaly shape."""
    from pyspark.sql import functions as F

    cols = df.columns
    return df.select(
        F.col("run"),
        F.lit(kind).alias("kind"),
        (F.col("guid") if "guid" in cols else F.lit(None).cast("string")).alias("guid"),
        (F.col("sub") if "sub" in cols else F.lit(None).cast("string")).alias("subscriber"),
        (F.col("topic") if "topic" in cols else F.lit(None).cast("string")).alias("topic"),
        detail.alias("detail"),
        (
            F.col("mono_ns")
            if "mono_ns" in cols
            else F.col("ok_ns")
            if "ok_ns" in cols
            else F.lit(None).cast("long")
        ).alias("mono_ns"),
    )


def _filter_regexes(spark: SparkSession, subs: DataFrame) -> DataFrame:
    """(filter, regex) for the distinct filters: a handful of rows, converted on the driver."""
    filters = [r["filter"] for r in subs.select("filter").distinct().collect() if r["filter"] is not None]
    rows: list[tuple[str, str]] = []
    for f in filters:
        try:
            rows.append((f, filter_to_regex(f)))
        except ValueError:
            rows.append((f, "^(?!)$"))  # an invalid filter matches nothing
    return spark.createDataFrame(rows, "filter string, regex string")


def analyze(events: DataFrame, *, corruption_excuses_loss: bool = True) -> Analysis:
    """Build the verification plan over a history DataFrame with the schema of history.FIELDS."""
    from pyspark.sql import Window as W
    from pyspark.sql import functions as F

    spark = events.sparkSession
    ev = events.where(F.col("run").isNotNull())

    # --- sessions: incarnation (subscriber identity) and connection number for every session event
    is_connack = (F.col("op") == "connect") & (F.col("type") == "ok")
    is_break = is_connack & ~F.coalesce(F.col("session_present"), F.lit(True))
    w_sess = W.partitionBy("run", "session").orderBy("mono_ns", "index").rowsBetween(W.unboundedPreceding, 0)
    sev = (
        ev.where(
            F.col("session").isNotNull()
            & F.col("op").isin("deliver", "ack", "subscribe", "unsubscribe", "connect", "disconnect", "publish")
        )
        .withColumn("inc", F.sum(F.when(is_break, 1).otherwise(0)).over(w_sess))
        .withColumn("conn", F.sum(F.when(is_connack, 1).otherwise(0)).over(w_sess))
        .withColumn("sub", F.concat_ws("#", F.col("session"), F.col("inc").cast("string")))
        .localCheckpoint()
    )
    final_inc = sev.groupBy("run", "session").agg(F.max("inc").alias("final_inc"))
    # A session was drained when its last connection event is a successful connect or a clean disconnect.
    conn_events = sev.where(F.col("op").isin("connect", "disconnect") & F.col("type").isin("ok", "info"))
    last_conn = conn_events.groupBy("run", "session").agg(
        F.max_by(F.struct(F.col("op"), F.col("type")), F.struct(F.col("mono_ns"), F.col("index"))).alias(
            "last"
        )
    )
    drained = last_conn.select(
        "run",
        "session",
        ((F.col("last.op") == "connect") | (F.col("last.type") == "ok")).alias("drained"),
    )

    # --- publishes: one row per (run, guid)
    pub = ev.where((F.col("op") == "publish") & F.col("guid").isNotNull())
    # The publisher session's incarnation at each invoke (a message sent again on a new session
    # cannot be de-duplicated by the broker without a guid).
    pub_inc = sev.where((F.col("op") == "publish") & (F.col("type") == "invoke")).select(
        "run", "guid", "inc"
    )
    is_invoke = F.col("type") == "invoke"
    msgs = (
        pub.groupBy("run", "guid")
        .agg(
            F.min(F.when(is_invoke, F.col("mono_ns"))).alias("invoke_ns"),
            F.min(F.when(F.col("type") == "ok", F.struct("mono_ns", "index"))).alias("ok_first"),
            F.max(F.when(F.col("type") == "fail", 1).otherwise(0)).alias("failed"),
            F.max("topic").alias("topic"),
            F.max("qos").alias("pub_qos"),
            F.max("session").alias("pub_session"),
            F.max(is_invoke & (F.coalesce(F.col("detail"), F.lit("")) == NO_GUID)).alias("no_guid"),
            F.sum(F.when(is_invoke, 1).otherwise(0)).alias("invokes"),
        )
        .join(pub_inc.groupBy("run", "guid").agg(F.countDistinct("inc").alias("pub_incs")), ["run", "guid"], "left")
        .withColumn("ok_ns", F.col("ok_first.mono_ns"))
        .withColumn("ok_index", F.col("ok_first.index"))
        # Sent without a guid and more than once where the broker cannot de-duplicate it (QoS 1,
        # or QoS 2 on a new publisher session): it may be stored, and delivered, twice.
        .withColumn(
            "may_repeat",
            F.coalesce(
                F.col("no_guid")
                & (F.col("invokes") > 1)
                & ((F.col("pub_qos") == 1) | (F.coalesce(F.col("pub_incs"), F.lit(0)) > 1)),
                F.lit(False),
            ),
        )
        .withColumn(
            "status",
            F.when(F.col("ok_ns").isNotNull(), "ok")
            .when(F.col("failed") == 1, "fail")
            .otherwise("indeterminate"),
        )
        .localCheckpoint()
    )
    acked = msgs.where(F.col("status") == "ok")

    # --- deliveries and packet ids
    pid_cols = ("run", "session", "sub", "conn", "guid", "topic", "qos", "packet_id")
    is_retained = F.coalesce(F.col("detail") == RETAINED, F.lit(False))
    dl = sev.where((F.col("op") == "deliver") & (F.col("type") == "ok")).select(
        *pid_cols,
        F.coalesce(F.col("dup"), F.lit(False)).alias("dup"),
        is_retained.alias("retained"),
        "mono_ns",
        "index",
        F.lit("d").alias("kind"),
    )
    acks = sev.where(F.col("op") == "ack").select(
        *pid_cols, F.lit(False).alias("dup"), F.lit(False).alias("retained"), "mono_ns", "index", F.lit("a").alias("kind")
    )
    w_pid = W.partitionBy("run", "sub", "packet_id").orderBy("mono_ns", "index")
    pid_stream = (
        dl.where(F.col("qos") > 0)
        .unionByName(acks.where(F.col("packet_id").isNotNull()))
        .withColumn("prev_kind", F.lag("kind").over(w_pid))
        .withColumn("prev_guid", F.lag("guid").over(w_pid))
        .withColumn("held_conn", F.lag("conn").over(w_pid))
        .withColumn("held_ns", F.lag("mono_ns").over(w_pid))
        .where(F.col("kind") == "d")
    )
    # Packet id reused for another message while the first still held it (not yet acknowledged).
    pid_reuse = pid_stream.where((F.col("prev_kind") == "d") & ~F.col("prev_guid").eqNullSafe(F.col("guid")))
    # QoS 2 resend with the held packet id: the protocol's own retransmission, not a second delivery.
    inflight_all = pid_stream.where(
        (F.col("qos") == 2) & (F.col("prev_kind") == "d") & F.col("prev_guid").eqNullSafe(F.col("guid"))
    ).localCheckpoint()
    inflight_resend = inflight_all.select("run", "sub", "mono_ns", "index")
    app = dl.join(inflight_resend, ["run", "sub", "mono_ns", "index"], "left_anti")

    # A retained copy sent for a new SUBSCRIBE (RETAIN=1, MQTT-3.3.1-6, once per matching filter:
    # MQTT-3.8.4-4) is not a second delivery: a repeat is compared with the subscriber's previous
    # live (non-retained) copy of the message, and one with only retained copies before it, or a
    # retained copy itself, is a copy MQTT asks for.
    w_g = W.partitionBy("run", "sub", "guid").orderBy("mono_ns", "index")
    w_before = w_g.rowsBetween(W.unboundedPreceding, -1)
    app = (
        app.join(msgs.select("run", "guid", "may_repeat"), ["run", "guid"], "left")
        .withColumn("may_repeat", F.coalesce(F.col("may_repeat"), F.lit(False)))
        .withColumn("k", F.row_number().over(w_g))
        .withColumn("live_before", F.sum(F.when(~F.col("retained"), 1).otherwise(0)).over(w_before))
        .withColumn(
            "prev_conn",
            F.coalesce(
                F.last(F.when(~F.col("retained"), F.col("conn")), ignorenulls=True).over(w_before),
                F.lag("conn").over(w_g),
            ),
        )
        .withColumn(
            "prev_pid",
            F.when(
                F.coalesce(F.col("live_before"), F.lit(0)) > 0,
                F.last(F.when(~F.col("retained"), F.col("packet_id")), ignorenulls=True).over(w_before),
            ).otherwise(F.lag("packet_id").over(w_g)),
        )
        .withColumn("orig_ns", F.first("mono_ns").over(w_g.rowsBetween(W.unboundedPreceding, 0)))
        # A repeat the rules do not judge: a message without a guid the broker may have stored
        # twice, a retained copy, or one whose earlier copies were all retained.
        .withColumn(
            "repeatable",
            F.col("may_repeat") | F.col("retained") | (F.coalesce(F.col("live_before"), F.lit(0)) == 0),
        )
        .localCheckpoint()
    )
    pid_changed = app.where(
        (F.col("k") > 1)
        & (F.col("qos") > 0)
        & F.col("prev_pid").isNotNull()
        & (F.col("prev_pid") != F.col("packet_id"))
        & ~F.col("repeatable")
    )
    repeats = app.where(F.col("k") > 1)
    legit_repeat = F.col("repeatable") | (
        (F.col("qos") == 1) & F.col("dup") & (F.col("conn") > F.col("prev_conn"))
    )
    dup_bad = repeats.where(~legit_repeat)
    dup_legit = repeats.where(legit_repeat)
    first = (
        app.where(F.col("k") == 1)
        .drop("k", "prev_conn", "prev_pid", "orig_ns", "live_before", "repeatable")
        .localCheckpoint()
    )

    # --- unexpected: delivered but never published (or without a guid), and refused-but-delivered
    known = pub.select("run", "guid").distinct()
    unexpected = first.where(F.col("guid").isNull()).unionByName(
        first.where(F.col("guid").isNotNull()).join(known, ["run", "guid"], "left_anti")
    )
    refused_delivered = first.join(
        msgs.where(F.col("status") == "fail").select("run", "guid"), ["run", "guid"], "inner"
    )

    # --- subscriptions and entitlement
    subscribed = (
        sev.where((F.col("op") == "subscribe") & (F.col("type") == "ok"))
        .groupBy("run", "session", "sub", "inc", "filter", "share_group")
        .agg(
            F.min("mono_ns").alias("first_sub_ns"),
            F.max("mono_ns").alias("last_sub_ns"),
            F.max("qos").alias("granted"),
            F.max(F.coalesce(F.col("sticky"), F.lit(False))).alias("sticky"),
            F.max(F.coalesce(F.col("no_local"), F.lit(False))).alias("no_local"),
        )
    )
    unsubscribed = (
        sev.where((F.col("op") == "unsubscribe") & (F.col("type") == "ok"))
        .groupBy("run", "sub", "filter", "share_group")
        .agg(F.max("mono_ns").alias("unsub_ns"))
    )
    # Joined null-safe: a plain subscription's share_group is null, and null = null is not true
    # in a join (an UNSUBACK of a plain subscription must end it, MQTT-3.10.4-2).
    u = unsubscribed.select(
        F.col("run").alias("u_run"),
        F.col("sub").alias("u_sub"),
        F.col("filter").alias("u_filter"),
        F.col("share_group").alias("u_group"),
        "unsub_ns",
    )
    on_unsub = (
        (F.col("run") == F.col("u_run"))
        & (F.col("sub") == F.col("u_sub"))
        & F.col("filter").eqNullSafe(F.col("u_filter"))
        & F.col("share_group").eqNullSafe(F.col("u_group"))
    )
    subs = (
        subscribed.join(u, on_unsub, "left")
        .drop("u_run", "u_sub", "u_filter", "u_group")
        .join(final_inc, ["run", "session"], "left")
        .join(drained, ["run", "session"], "left")
        .withColumn(
            "start_ns",
            F.when(F.col("unsub_ns").isNull(), F.col("first_sub_ns")).otherwise(F.col("last_sub_ns")),
        )
        # Entitles only while it lasts to the end: same incarnation, not unsubscribed, drained.
        .withColumn(
            "live",
            (F.col("inc") == F.col("final_inc"))
            & (F.col("unsub_ns").isNull() | (F.col("unsub_ns") < F.col("last_sub_ns")))
            & F.coalesce(F.col("drained"), F.lit(False)),
        )
    )
    subs = subs.join(F.broadcast(_filter_regexes(spark, subs)), ["filter"], "left").localCheckpoint()

    drops = ev.where(F.col("op") == "drop").select(
        "run", "guid", F.col("session").alias("drop_session"), "reason"
    )

    drops_k = drops.select(F.col("run").alias("d_run"), F.col("guid").alias("d_guid"), "drop_session")

    def excused_by_drop(pairs: DataFrame, session_col: str) -> DataFrame:
        """The rows of ``pairs`` whose (message, session) a counted broker drop excuses."""
        cond = (
            (F.col("run") == F.col("d_run"))
            & (F.col("guid") == F.col("d_guid"))
            & (F.col("drop_session").isNull() | (F.col("drop_session") == F.col(session_col)))
        )
        return pairs.join(drops_k, cond, "left_semi")

    match = F.expr("topic rlike regex")
    # Plain subscriptions: pairs (subscriber, acknowledged message) the subscriber is owed.
    plain = subs.where(F.col("share_group").isNull() & F.col("live"))
    owed = (
        plain.join(acked, "run")
        .where((F.col("start_ns") < F.col("invoke_ns")) & match)
        .where(~(F.col("no_local") & (F.col("pub_session") == F.col("session"))))
        # Overlapping filters: the broker delivers once, at the highest granted QoS (MQTT-3.3.4-2),
        # so that QoS decides whether QoS 0 excuses a missing delivery.
        .groupBy("run", "sub", "session", "guid")
        .agg(
            F.max("topic").alias("topic"),
            F.max("granted").alias("granted"),
            F.max("pub_qos").alias("pub_qos"),
            F.max("ok_ns").alias("ok_ns"),
        )
    )
    owed_undelivered = owed.join(first.select("run", "sub", "guid"), ["run", "sub", "guid"], "left_anti")
    qos0 = owed_undelivered.where((F.col("granted") == 0) | (F.col("pub_qos") == 0))
    not_qos0 = owed_undelivered.where((F.col("granted") > 0) & (F.col("pub_qos") > 0))
    dropped = excused_by_drop(not_qos0, "session")
    lost_plain = not_qos0.join(dropped.select("run", "sub", "guid"), ["run", "sub", "guid"], "left_anti")

    # $share groups: one delivery owed per group (group key: run, share_group, filter).
    share = subs.where(F.col("share_group").isNotNull())
    members = share.select("run", "share_group", "filter", "session").distinct()
    share_owed = (
        share.where(F.col("live"))
        .join(acked, "run")
        .where((F.col("start_ns") < F.col("invoke_ns")) & match)
        .groupBy("run", "share_group", "filter", "guid")
        .agg(
            F.max("topic").alias("topic"),
            F.max("granted").alias("granted"),
            F.max("pub_qos").alias("pub_qos"),
            F.max("ok_ns").alias("ok_ns"),
        )
    )
    share_delivered = (
        first.select("run", "session", "guid")
        .join(members, ["run", "session"])
        .select("run", "share_group", "filter", "guid")
        .distinct()
    )
    share_undelivered = share_owed.join(
        share_delivered, ["run", "share_group", "filter", "guid"], "left_anti"
    )
    share_not_qos0 = share_undelivered.where((F.col("granted") > 0) & (F.col("pub_qos") > 0))
    share_cand = share_not_qos0.join(members, ["run", "share_group", "filter"])  # one row per member
    share_dropped = (
        excused_by_drop(share_cand, "session").select("run", "share_group", "filter", "guid").distinct()
    )
    lost_share = share_not_qos0.join(
        share_dropped, ["run", "share_group", "filter", "guid"], "left_anti"
    ).withColumn("sub", F.concat(F.lit("$share/"), F.col("share_group"), F.lit("/"), F.col("filter")))
    excused_count = (
        qos0.select("run")
        .unionByName(dropped.select("run"))
        .unionByName(share_undelivered.where((F.col("granted") == 0) | (F.col("pub_qos") == 0)).select("run"))
        .unionByName(share_dropped.select("run"))
        .groupBy("run")
        .count()
        .withColumnRenamed("count", "excused")
    )

    # $share: a second member receiving the message. Legitimate only for QoS 1 after the previous
    # member's session ended (a later clean/expired session, a counted drop, or it left for good).
    ends = (
        sev.where(is_break)
        .select("run", "session", "mono_ns")
        .unionByName(
            drops.where(
                F.col("reason").isin("session_expired", "share_qos2_member_gone")
                & F.col("drop_session").isNotNull()
            ).select(
                "run", F.col("drop_session").alias("session"), F.lit(2**62).cast("long").alias("mono_ns")
            )
        )
        .unionByName(
            last_conn.where((F.col("last.op") == "disconnect") & (F.col("last.type") == "info")).select(
                "run", "session", F.lit(2**62).cast("long").alias("mono_ns")
            )
        )
        .groupBy("run", "session")
        .agg(F.max("mono_ns").alias("end_ns"))
    )
    w_share = W.partitionBy("run", "share_group", "filter", "guid").orderBy("mono_ns", "index")
    share_multi = (
        first.join(members, ["run", "session"])
        .withColumn("prev_session", F.lag("session").over(w_share))
        .withColumn("prev_ns", F.lag("mono_ns").over(w_share))
        .withColumn("prev_qos", F.lag("qos").over(w_share))
        .where(F.col("prev_session").isNotNull())
        .join(ends.withColumnRenamed("session", "prev_session"), ["run", "prev_session"], "left")
    )
    # The QoS the previous member received it at decides (MQTT-4.8.2-4/5): a QoS 1 claim goes back
    # to the group when that member's session ends, a QoS 2 one never does.
    share_legit = (F.col("prev_qos") == 1) & F.col("end_ns").isNotNull() & (F.col("end_ns") > F.col("prev_ns"))
    share_dup_bad = share_multi.where(~share_legit)
    share_dup_legit = share_multi.where(share_legit)

    # --- order of first deliveries: per (subscriber, topic, publisher) a subsequence of the
    # publisher's acknowledged order. Deliveries through non-sticky $share subscriptions are exempt.
    checked_subs = subs.where(F.col("share_group").isNull() | F.col("sticky")).select("run", "sub", "regex")
    # A message that may have been stored twice (no guid) is left out: each copy has its own place
    # in the log, and the history cannot tell which copy a delivery is.
    first_checked = (
        first.where(~F.col("may_repeat"))
        .join(checked_subs, ["run", "sub"])
        .where(match)
        .select("run", "sub", "guid", "topic", "mono_ns", "index")
        .dropDuplicates(["run", "sub", "guid"])
    )
    # The publisher's acknowledged order: ack time, ties (several acknowledgements read at once)
    # by record order, the order the publisher saw them in.
    w_prank = W.partitionBy("run", "pub_session", "topic").orderBy("ok_ns", "ok_index")
    ranked = acked.withColumn("prank", F.row_number().over(w_prank)).select(
        "run", "guid", "pub_session", "prank"
    )
    w_ord = (
        W.partitionBy("run", "sub", "topic", "pub_session")
        .orderBy("mono_ns", "index")
        .rowsBetween(W.unboundedPreceding, -1)
    )
    out_of_order = (
        first_checked.join(ranked, ["run", "guid"])
        .withColumn("prev_max", F.max("prank").over(w_ord))
        .where(F.col("prank") < F.col("prev_max"))
    )

    # --- resends after a reconnect: in original order, before anything new, from the oldest unacked.
    checked_app = (
        app.join(checked_subs, ["run", "sub"])
        .where(match)
        .select(
            "run",
            "sub",
            "session",
            "guid",
            "topic",
            "qos",
            "conn",
            "prev_conn",
            "k",
            "orig_ns",
            "mono_ns",
            "index",
            "may_repeat",
            "retained",
        )
        .dropDuplicates(["run", "sub", "mono_ns", "index"])
        .localCheckpoint()
    )
    w_conn = (
        W.partitionBy("run", "sub", "topic", "conn")
        .orderBy("mono_ns", "index")
        .rowsBetween(W.unboundedPreceding, -1)
    )
    # Resends after a reconnect (a repeat in the same connection is already a duplicate), not of a
    # message that may be stored twice nor a retained copy; and the protocol's own QoS 2 resend with
    # the held packet id on a later connection (MQTT-4.4.0-1), which keeps the original order too.
    first_app_ns = app.where(F.col("k") == 1).select("run", "sub", "guid", F.col("mono_ns").alias("first_ns"))
    inflight_reps = (
        inflight_all.where(F.col("conn") > F.col("held_conn"))
        .join(checked_subs, ["run", "sub"])
        .where(match)
        .join(first_app_ns, ["run", "sub", "guid"], "left")
        .select(
            "run",
            "sub",
            "session",
            "guid",
            "topic",
            "conn",
            F.coalesce(F.col("first_ns"), F.col("held_ns")).alias("orig_ns"),
            "mono_ns",
            "index",
        )
        .dropDuplicates(["run", "sub", "mono_ns", "index"])
    )
    checked_reps = (
        checked_app.where(
            (F.col("k") > 1) & (F.col("conn") > F.col("prev_conn")) & ~F.col("may_repeat") & ~F.col("retained")
        )
        .select("run", "sub", "session", "guid", "topic", "conn", "orig_ns", "mono_ns", "index")
        .unionByName(inflight_reps)
    )
    resend_misordered = checked_reps.withColumn("prev_orig", F.max("orig_ns").over(w_conn)).where(
        F.col("orig_ns") < F.col("prev_orig")
    )
    first_new = (
        checked_app.where(F.col("k") == 1)
        .groupBy("run", "sub", "topic", "conn")
        .agg(F.min("mono_ns").alias("first_new_ns"))
    )
    resend_after_new = checked_reps.join(first_new, ["run", "sub", "topic", "conn"]).where(
        F.col("mono_ns") > F.col("first_new_ns")
    )
    conn_start = sev.where(is_connack).select("run", "session", "conn", F.col("mono_ns").alias("conn_ns"))
    rep_span = (
        checked_reps.groupBy("run", "sub", "session", "topic", "conn")
        .agg(F.max("orig_ns").alias("max_orig_ns"))
        .join(conn_start, ["run", "session", "conn"])
    )
    first_acks = acks.groupBy("run", "sub", "guid").agg(F.min("mono_ns").alias("ack_ns"))
    # Older unacknowledged messages: a QoS 0 delivery has no acknowledgement and is never resent
    # (MQTT-4.3.1), so only QoS > 0 deliveries are owed a resend (MQTT-4.4.0-1).
    older = (
        checked_app.where((F.col("k") == 1) & (F.col("qos") > 0))
        .select(
            "run",
            "sub",
            "topic",
            "guid",
            F.col("conn").alias("first_conn"),
            F.col("mono_ns").alias("first_ns"),
        )
        .join(first_acks, ["run", "sub", "guid"], "left")
        .join(rep_span, ["run", "sub", "topic"])
        .where(
            (F.col("first_conn") < F.col("conn"))
            & (F.col("first_ns") < F.col("max_orig_ns"))
            & (F.col("ack_ns").isNull() | (F.col("ack_ns") > F.col("conn_ns")))
        )
    )
    # Continued on this connection: delivered on it again (also a QoS 2 resend with the held packet
    # id), or (QoS 2 past PUBREC) released by PUBREL -> PUBCOMP.
    continued = dl.select("run", "sub", "guid", "conn").unionByName(acks.select("run", "sub", "guid", "conn"))
    skipped = older.join(continued, ["run", "sub", "guid", "conn"], "left_anti")
    skipped_excused = excused_by_drop(skipped, "session").select("run", "sub", "guid", "conn")
    skipped = skipped.join(skipped_excused, ["run", "sub", "guid", "conn"], "left_anti").withColumn(
        "mono_ns", F.col("conn_ns")
    )

    # --- faults and detected corruption
    faults = ev.where(F.col("op") == "fault")
    corrupted_runs = faults.where(F.col("reason") == "corruption_detected").select("run").distinct()
    lost_all = lost_plain.select("run", "guid", "sub", "topic", "ok_ns").unionByName(
        lost_share.select("run", "guid", "sub", "topic", "ok_ns")
    )
    if corruption_excuses_loss:
        lost_detected = lost_all.join(corrupted_runs, "run", "left_semi")
        lost_silent = lost_all.join(corrupted_runs, "run", "left_anti")
    else:
        lost_detected = lost_all.limit(0)
        lost_silent = lost_all

    anomalies = (
        _anoms(lost_silent, "lost", F.lit("acknowledged, owed, never delivered, not excused"))
        .unionByName(
            _anoms(
                lost_detected,
                "lost_detected_corruption",
                F.lit("lost in a run where the node reported corruption"),
            )
        )
        .unionByName(
            _anoms(
                dup_bad,
                "duplicate",
                F.concat(
                    F.lit("delivery #"),
                    F.col("k").cast("string"),
                    F.lit(" qos="),
                    F.col("qos").cast("string"),
                    F.lit(" dup="),
                    F.col("dup").cast("string"),
                    F.lit(" conn="),
                    F.col("conn").cast("string"),
                    F.lit(" prev_conn="),
                    F.col("prev_conn").cast("string"),
                ),
            )
        )
        .unionByName(
            _anoms(
                share_dup_bad.withColumn("sub", F.col("session")),
                "duplicate",
                F.concat(
                    F.lit("$share/"),
                    F.col("share_group"),
                    F.lit(": also delivered to "),
                    F.col("prev_session"),
                    F.lit(" qos="),
                    F.col("qos").cast("string"),
                ),
            )
        )
        .unionByName(_anoms(unexpected, "unexpected", F.lit("delivered but never published")))
        .unionByName(_anoms(refused_delivered, "refused_delivered", F.lit("publish refused, yet delivered")))
        .unionByName(
            _anoms(
                out_of_order,
                "out_of_order",
                F.concat(
                    F.lit("first delivery of publisher "),
                    F.col("pub_session"),
                    F.lit(" #"),
                    F.col("prank").cast("string"),
                    F.lit(" after #"),
                    F.col("prev_max").cast("string"),
                ),
            )
        )
        .unionByName(_anoms(resend_misordered, "out_of_order", F.lit("resend not in original order")))
        .unionByName(_anoms(resend_after_new, "out_of_order", F.lit("resend after a new message")))
        .unionByName(
            _anoms(
                skipped,
                "out_of_order",
                F.concat(
                    F.lit("unacknowledged message not resent on connection "),
                    F.col("conn").cast("string"),
                    F.lit(" although a newer one was"),
                ),
            )
        )
        .unionByName(
            _anoms(
                pid_reuse,
                "packet_id_misuse",
                F.concat(
                    F.lit("packet id "),
                    F.col("packet_id").cast("string"),
                    F.lit(" reused while held by "),
                    F.col("prev_guid"),
                ),
            )
        )
        .unionByName(
            _anoms(
                pid_changed,
                "packet_id_misuse",
                F.concat(
                    F.lit("resent with packet id "),
                    F.col("packet_id").cast("string"),
                    F.lit(", original "),
                    F.col("prev_pid").cast("string"),
                ),
            )
        )
    )

    # Materialised here: the anomaly plan is deep and every output below reads it.
    anomalies = anomalies.localCheckpoint()
    per_run = _per_run(ev, msgs, dl, app, excused_count, dup_legit, share_dup_legit, anomalies, faults)
    timeline = _timeline(ev, msgs, first)
    run_start = ev.groupBy("run").agg(F.min("mono_ns").alias("start_ns"))
    fault_rows = faults.join(run_start, "run").select(
        "run", ((F.col("mono_ns") - F.col("start_ns")) / 1e9).alias("t_s"), "reason", "detail"
    )
    return Analysis(
        anomalies=anomalies,
        per_run=per_run,
        timeline=timeline,
        faults=fault_rows,
        latency=_latency(msgs, first),
    )


def _per_run(
    ev: DataFrame,
    msgs: DataFrame,
    dl: DataFrame,
    app: DataFrame,
    excused: DataFrame,
    dup_legit: DataFrame,
    share_dup_legit: DataFrame,
    anomalies: DataFrame,
    faults: DataFrame,
) -> DataFrame:
    from pyspark.sql import functions as F

    delivered_any = app.select("run", "guid").distinct()
    m = msgs.join(delivered_any.withColumn("delivered", F.lit(1)), ["run", "guid"], "left")
    lat_ack = (F.col("ok_ns") - F.col("invoke_ns")) / NS_PER_MS
    pub_stats = m.groupBy("run").agg(
        F.count("*").alias("published"),
        F.sum(F.when(F.col("status") == "ok", 1).otherwise(0)).alias("acknowledged"),
        F.sum(F.when(F.col("status") == "fail", 1).otherwise(0)).alias("refused"),
        F.sum(F.when(F.col("status") == "indeterminate", 1).otherwise(0)).alias("indeterminate"),
        F.sum(
            F.when((F.col("status") == "indeterminate") & F.col("delivered").isNotNull(), 1).otherwise(0)
        ).alias("indeterminate_delivered"),
        F.percentile_approx(lat_ack, [0.5, 0.9, 0.99], 1000).alias("ack_ms_pcts"),
        F.max(lat_ack).alias("ack_ms_max"),
    )
    first_app = app.where(F.col("k") == 1).join(msgs.select("run", "guid", "invoke_ns"), ["run", "guid"])
    lat_dl = (F.col("mono_ns") - F.col("invoke_ns")) / NS_PER_MS
    dl_stats = (
        dl.groupBy("run")
        .agg(F.count("*").alias("deliveries_received"))
        .join(
            first_app.groupBy("run").agg(
                F.count("*").alias("first_deliveries"),
                F.percentile_approx(lat_dl, [0.5, 0.9, 0.99], 1000).alias("deliver_ms_pcts"),
                F.max(lat_dl).alias("deliver_ms_max"),
            ),
            "run",
            "left",
        )
    )
    legit = (
        dup_legit.select("run")
        .unionByName(share_dup_legit.select("run"))
        .groupBy("run")
        .count()
        .withColumnRenamed("count", "duplicate_legit")
    )
    kinds = anomalies.groupBy("run").pivot("kind", list(ALL_KINDS)).count()
    fault_counts = (
        faults.groupBy("run")
        .pivot("reason", ["kill", "restart", "truncate", "bitflip", "corruption_detected"])
        .count()
    )
    fault_counts = fault_counts.select(
        "run", *[F.col(c).alias(f"fault_{c}") for c in fault_counts.columns if c != "run"]
    )
    runs = ev.groupBy("run").agg(
        F.count("*").alias("events"),
        ((F.max("mono_ns") - F.min("mono_ns")) / 1e9).alias("duration_s"),
        # What was tested: sessions that subscribed, and every fault record (any kind).
        F.countDistinct(F.when((F.col("op") == "subscribe") & (F.col("type") == "ok"), F.col("session"))).alias(
            "subscribers"
        ),
        F.sum(F.when(F.col("op") == "fault", 1).otherwise(0)).alias("faults"),
    )
    out = (
        runs.join(pub_stats, "run", "left")
        .join(dl_stats, "run", "left")
        .join(excused, "run", "left")
        .join(legit, "run", "left")
        .join(kinds, "run", "left")
        .join(fault_counts, "run", "left")
    )
    zero_cols = [
        "excused",
        "duplicate_legit",
        *ALL_KINDS,
        *[f"fault_{c}" for c in ["kill", "restart", "truncate", "bitflip", "corruption_detected"]],
        "published",
        "acknowledged",
        "refused",
        "indeterminate",
        "indeterminate_delivered",
        "deliveries_received",
        "first_deliveries",
        "subscribers",
        "faults",
    ]
    return out.fillna(0, subset=zero_cols)


def _timeline(ev: DataFrame, msgs: DataFrame, first: DataFrame) -> DataFrame:
    from pyspark.sql import functions as F

    start = ev.groupBy("run").agg(F.min("mono_ns").alias("start_ns"))
    acked = (
        msgs.where(F.col("status") == "ok")
        .join(start, "run")
        .select(
            "run",
            F.floor((F.col("ok_ns") - F.col("start_ns")) / 1e9).cast("int").alias("second"),
            ((F.col("ok_ns") - F.col("invoke_ns")) / NS_PER_MS).alias("ack_ms"),
        )
    )
    per_s = acked.groupBy("run", "second").agg(
        F.count("*").alias("acked"),
        F.percentile_approx("ack_ms", [0.5, 0.99], 200).alias("ack_pcts"),
    )
    delivered = (
        first.join(start, "run")
        .select("run", F.floor((F.col("mono_ns") - F.col("start_ns")) / 1e9).cast("int").alias("second"))
        .groupBy("run", "second")
        .agg(F.count("*").alias("delivered"))
    )
    return per_s.join(delivered, ["run", "second"], "full").select(
        "run",
        "second",
        F.coalesce("acked", F.lit(0)).alias("acked"),
        F.coalesce("delivered", F.lit(0)).alias("delivered"),
        F.col("ack_pcts")[0].alias("ack_p50_ms"),
        F.col("ack_pcts")[1].alias("ack_p99_ms"),
    )


def _latency(msgs: DataFrame, first: DataFrame) -> DataFrame:
    """Percentiles of publish->ack and publish->first delivery over every run together."""
    from pyspark.sql import functions as F

    ack = msgs.where(F.col("status") == "ok").select(
        ((F.col("ok_ns") - F.col("invoke_ns")) / NS_PER_MS).alias("ms")
    )
    dlv = first.join(msgs.select("run", "guid", "invoke_ns"), ["run", "guid"]).select(
        ((F.col("mono_ns") - F.col("invoke_ns")) / NS_PER_MS).alias("ms")
    )
    pcts = [0.5, 0.9, 0.99, 0.999]

    def stats(df: DataFrame, prefix: str) -> DataFrame:
        return df.agg(
            F.percentile_approx("ms", pcts, 10000).alias(f"{prefix}_pcts"), F.max("ms").alias(f"{prefix}_max")
        )

    return stats(ack, "ack").crossJoin(stats(dlv, "deliver"))
