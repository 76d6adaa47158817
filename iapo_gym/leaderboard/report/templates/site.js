// Sortable tables: each column header holds a <button>; activating it (click, Enter or Space)
// sorts the rows by that column's data-sort values and updates aria-sort. No libraries.
(function () {
  "use strict";
  function value(row, index, type) {
    var cell = row.children[index];
    var raw = cell ? cell.getAttribute("data-sort") : "";
    if (type === "num") {
      var x = parseFloat(raw);
      return isNaN(x) ? null : x;
    }
    return (raw === null ? cell.textContent : raw).toLowerCase();
  }
  function sortBy(table, th) {
    var headers = Array.prototype.slice.call(table.tHead.rows[0].cells);
    var index = headers.indexOf(th);
    var button = th.querySelector("button");
    var type = button.getAttribute("data-type");
    var current = th.getAttribute("aria-sort");
    var first = button.getAttribute("data-first") || "ascending";
    var order = current === "none" || current === null ? first : (current === "ascending" ? "descending" : "ascending");
    var sign = order === "ascending" ? 1 : -1;
    var body = table.tBodies[0];
    var rows = Array.prototype.slice.call(body.rows).map(function (row, i) { return { row: row, i: i }; });
    rows.sort(function (a, b) {
      var x = value(a.row, index, type), y = value(b.row, index, type);
      if (x === y) { return a.i - b.i; }
      if (x === null) { return 1; }
      if (y === null) { return -1; }
      return (x < y ? -1 : 1) * sign;
    });
    rows.forEach(function (r) { body.appendChild(r.row); });
    headers.forEach(function (h) { h.setAttribute("aria-sort", h === th ? order : "none"); });
    var status = table.closest("section").querySelector(".status");
    if (status) { status.textContent = "Sorted by " + button.textContent + ", " + order + "."; }
  }
  document.querySelectorAll("table.sortable").forEach(function (table) {
    table.tHead.querySelectorAll("th").forEach(function (th) {
      var button = th.querySelector("button");
      if (button) { button.addEventListener("click", function () { sortBy(table, th); }); }
    });
  });
}());
